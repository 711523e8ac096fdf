"""What a run started through Prefect may not change: the campaign's promises.

A deployment's run takes the whole campaign config as its parameter, and Prefect's own server has no user
accounts: whoever can start a run (the UI's "Run" form with custom parameters, one API call) could otherwise
change what the campaign promises, e.g. switch ``promotion.approval`` from "required" to "auto" so the next
promotion waits for nobody, lower the gate, or point the run at another store. So a run that comes from a
deployment (:func:`check`) must carry the same promised sections as the config the operator recorded in the
campaign's store (``evertrain serve`` and ``evertrain deploy`` record it when they register the deployment,
``evertrain run`` at every stage); anything else (sampling, the update's settings, iterations) it may change.
A run whose store holds no record of the campaign is refused too: a run cannot point itself at a fresh store.

The operator changes a promise where they hold the files: edit the campaign's TOML and run ``evertrain
serve``/``deploy`` (or ``evertrain run``) again.
"""

from __future__ import annotations

import json
from typing import Any

from evertrain.config import CampaignConfig, ConfigError
from evertrain.data.store import Store, now

# the config sections a run from a deployment may not change: what and how it trains toward (model,
# environments, curation's decontamination), the gate and the approval, where state lives, how it is served
PROMISES = ("model", "environments", "curation", "eval", "promotion", "paths", "serving")


class PromiseError(ConfigError):
    """A run started through Prefect asked to change what the campaign promises."""


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flat(inner, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def changes(recorded: CampaignConfig, asked: CampaignConfig) -> list[str]:
    """The promised settings ``asked`` changes from ``recorded`` ('promotion.approval: required -> auto')."""
    old, new = recorded.resolved().model_dump(mode="json"), asked.resolved().model_dump(mode="json")
    found = []
    for section in PROMISES:
        a, b = _flat(old.get(section), section), _flat(new.get(section), section)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                found.append(f"{key}: {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return found


def record(config: CampaignConfig) -> None:
    """Record ``config`` as the campaign's (an operator's command: ``evertrain serve`` or ``deploy``)."""
    with Store(config.paths.store) as store:
        store.replace("campaigns", {"campaign": config.name}, [{
            "campaign": config.name, "config": config.model_dump_json(), "updated_at": now()}])


def check(store: Store, config: CampaignConfig) -> None:
    """Refuse (:class:`PromiseError`) a run from a deployment whose config changes a promised setting of the
    config recorded for the campaign, or whose store holds no record of it."""
    raw = store.campaign_config(config.name)
    if raw is None:
        raise PromiseError(
            f"campaign {config.name!r} has no recorded config in store {store.location.describe()}: a run started "
            "through Prefect may not start a campaign of its own (or point one at another store). The operator "
            "records it with `evertrain serve` or `evertrain deploy` (or runs it once with `evertrain run`)")
    found = changes(CampaignConfig.model_validate_json(raw), config)
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise PromiseError(
            f"this run of campaign {config.name!r} was started through Prefect with settings the campaign promises "
            f"not to change from a run's parameters ({', '.join(PROMISES)}): {shown}. Nothing ran. To change them, "
            "edit the campaign's config and register it again (`evertrain serve` / `evertrain deploy`)")
