"""Bad input gets a clear error naming the problem, and nothing is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evertrain.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    assert load_config(ROOT / "configs" / "default.toml").model.path == "embedded:smollm2-135m-instruct"
    smoke = load_config(ROOT / "configs" / "smoke.toml")
    assert smoke.model.path == "embedded:tiny" and smoke.group_size >= 2


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_config_builds_its_environments(path):
    """Each environment of each shipped config is built with its options and draws train and held-out problems."""
    from evertrain.envs import registry

    config = load_config(path)
    for spec in config.environments:
        env = registry.get(spec.name, **spec.options)
        train = env.problems("train", 2, config.seed)
        held = env.problems("eval", config.eval_size(spec.name), config.seed)
        assert train and held, spec.name
        assert not {p.id for p in train} & {p.id for p in held}, spec.name
        assert env.messages(train[0])[-1]["content"].startswith(train[0].prompt)  # the terminal adds its files


@pytest.mark.parametrize(("data", "field", "words"), [
    ({"update": {"learning_rate": -1e-4}}, "update.learning_rate", "greater than 0"),
    ({"environments": [{"name": "chess"}]}, "environments", "unknown environment 'chess'"),
    ({"group_size": 1}, "group_size", "greater than or equal to 2"),
    ({"model": {"path": "/nonexistent/model"}}, "model.path", "does not exist"),
    ({"environments": [{"name": "arithmetic", "weight": -1}]}, "environments.0.weight", "greater than or equal to 0"),
    ({"environments": [{"name": "arithmetic", "weight": 0}]}, "environments", "at least one must supply"),
    ({"name": "no spaces"}, "name", "letters, digits"),
    ({"promotion": {"confidence": 0.9, "futility": 0.95}}, "promotion", "futility must be below"),
    ({"update": {"learnig_rate": 1e-4}}, "update.learnig_rate", "Extra inputs"),
])
def test_bad_values_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    message = str(caught.value)
    assert f"{field}:" in message and words in message


def test_corrupt_toml_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[update\nlearning_rate = 1\n')
    with pytest.raises(ConfigError, match=r"bad\.toml is not valid TOML"):
        load_config(bad)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def _evertrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A fresh `python -m evertrain.cli` process, as a user starts it: a config is read and refused before the
    training stack is imported (about 1.3 CPU-seconds a refusal, against 12 for a preloader's start, AMD EPYC)."""
    return subprocess.run([sys.executable, "-m", "evertrain.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("body", [
    '[update]\nlearning_rate = -0.1\n',
    '[[environments]]\nname = "nope"\n',
    'group_size = 1\n',
    '[model]\npath = "/no/such/model"\n',
    'name = "x"\n[update\n',
])
def test_cli_refuses_bad_config_and_writes_nothing(tmp_path, body):
    config = tmp_path / "campaign.toml"
    config.write_text(body)
    result = _evertrain(["run", "--config", str(config), "--iterations", "1"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "evertrain: error:" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["campaign.toml"]  # no store, no mlflow, nothing


def test_set_overrides_one_value_and_names_a_bad_one():
    config = load_config(ROOT / "configs" / "default.toml", ["generation.backend=vllm", "update.learning_rate=3e-4",
                                                            "environments.0.max_new_tokens=32"])
    assert (config.generation.backend, config.update.learning_rate) == ("vllm", 3e-4)
    assert config.environments[0].max_new_tokens == 32
    assert load_config(ROOT / "configs" / "default.toml").generation.backend == "auto"  # the file is untouched
    for setting, words in [("generation.backend", "expected KEY=VALUE"),
                           ("environments.7.weight=1", "not an index of a list of 2"),
                           ("seed.x=1", "seed is a value"),
                           ("generation.backend=gpu", "generation.backend: Input should be")]:
        with pytest.raises(ConfigError, match=words):
            load_config(ROOT / "configs" / "default.toml", [setting])


def test_cli_set_refuses_a_bad_override_and_writes_nothing(tmp_path):
    result = _evertrain(["run", "--config", str(ROOT / "configs" / "smoke.toml"), "--set", "update.learning_rate=-1",
                         "--iterations", "1"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "update.learning_rate:" in result.stderr and "--set update.learning_rate=-1" in result.stderr
    assert list(tmp_path.iterdir()) == []
