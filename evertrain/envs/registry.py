"""The registry of environments: a name maps to a class; ``rg:<generator>`` names are resolved lazily."""

from __future__ import annotations

import importlib
from typing import Any

from evertrain.envs.base import Environment

# name -> "module:Class"; modules import lazily so listing names stays cheap
BUILTIN: dict[str, str] = {
    "arithmetic": "evertrain.envs.arithmetic:Arithmetic",
    "digits": "evertrain.envs.digits:Digits",
    "gsm8k": "evertrain.envs.gsm8k:GSM8K",
    "gsm8k-tools": "evertrain.envs.gsm8k_tools:GSM8KTools",
    "sql": "evertrain.envs.sql:SqlQuestions",
    "code": "evertrain.envs.code:CodeEnvironment",
    "mbpp": "evertrain.envs.code:MBPP",
    "terminal": "evertrain.envs.terminal:Terminal",
    "calculator": "evertrain.envs.calculator:Calculator",
}


class UnknownEnvironment(ValueError):
    pass


RG_PREFIX = "rg:"  # rg:<generator> is any reasoning-gym generator
VF_PREFIX = "verifiers:"  # verifiers:<taskset id> is a verifiers (0.4) taskset, installed or on its `path` option
OPENENV_PREFIX = "openenv:"  # openenv:<name> is an OpenEnv environment server (its `app` or `url` option)


def rg_generators() -> list[str]:
    """Every reasoning-gym generator name (imports reasoning_gym, about a second)."""
    # late: like BUILTIN's, an adapter's module loads when its environment is built (config validation reads this
    # registry)
    from evertrain.envs.reasoning_gym import generator_names

    return generator_names()


def names(include_rg: bool = False) -> list[str]:
    """Every registered environment name (with every rg:<generator> when ``include_rg``)."""
    listed = sorted(BUILTIN)
    if include_rg:
        listed += [RG_PREFIX + name for name in rg_generators()]
    return listed


def check_name(name: str) -> None:
    """Raise UnknownEnvironment with the known names when ``name`` is not registered (a verifiers taskset's name
    is checked when it loads: its package may live on the environment's ``path`` option)."""
    if name.startswith(VF_PREFIX):
        if not name[len(VF_PREFIX):].strip():
            raise UnknownEnvironment(f"{name!r}: name the taskset, e.g. verifiers:vf-sums")
        return
    if name.startswith(OPENENV_PREFIX):
        if not name[len(OPENENV_PREFIX):].strip():
            raise UnknownEnvironment(f"{name!r}: name the environment, e.g. openenv:count")
        return
    if name.startswith(RG_PREFIX):
        if name[len(RG_PREFIX):] not in rg_generators():
            raise UnknownEnvironment(f"unknown reasoning-gym generator {name!r}; `evertrain envs` lists them")
        return
    if name not in BUILTIN:
        raise UnknownEnvironment(f"unknown environment {name!r}; known: {', '.join(names())}, rg:<generator>, "
                                 f"verifiers:<taskset>, openenv:<name>")


def get(name: str, **options: Any) -> Environment:
    """Build the environment called ``name`` with its options."""
    check_name(name)
    if name.startswith(RG_PREFIX):
        # late: like BUILTIN's, an adapter's module loads when its environment is built (config validation reads this
        # registry)
        from evertrain.envs.reasoning_gym import ReasoningGym

        return ReasoningGym(name[len(RG_PREFIX):], **options)
    if name.startswith(VF_PREFIX):
        # late: like BUILTIN's, an adapter's module loads when its environment is built (config validation reads this
        # registry)
        from evertrain.envs.verifiers_env import VerifiersEnvironment

        return VerifiersEnvironment(name[len(VF_PREFIX):], **options)
    if name.startswith(OPENENV_PREFIX):
        # late: like BUILTIN's, an adapter's module loads when its environment is built (config validation reads this
        # registry)
        from evertrain.envs.openenv_env import OpenEnvEnvironment

        return OpenEnvEnvironment(name[len(OPENENV_PREFIX):], **options)
    module, _, cls = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
