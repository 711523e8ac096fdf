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
    "code": "evertrain.envs.code:CodeEnvironment",
    "mbpp": "evertrain.envs.code:MBPP",
}


class UnknownEnvironment(ValueError):
    pass


def names() -> list[str]:
    """Every registered environment name."""
    return sorted(BUILTIN)


def check_name(name: str) -> None:
    """Raise UnknownEnvironment with the known names when ``name`` is not registered."""
    if name not in BUILTIN:
        raise UnknownEnvironment(f"unknown environment {name!r}; known: {', '.join(names())}")


def get(name: str, **options: Any) -> Environment:
    """Build the environment called ``name`` with its options."""
    check_name(name)
    module, _, cls = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
