"""The adaptive environment mix: each environment's share of an iteration follows how learnable it is now.

GRPO learns only from groups whose rewards disagree. An environment whose every recent group failed (or
every one passed) spends its share of the budget on rollouts that teach nothing; one near a 50% pass
rate teaches the most. So, with ``mix.adaptive = true``, curate splits each iteration's problems by

    raw_e   = weight_e * learnability_e
    share_e = floor + (1 - k * floor) * raw_e / sum(raw)      (k: environments with weight > 0)

where ``learnability_e`` is the mean of two measures over the scored rollouts of the last
``mix.window`` iterations: the share of informative groups (rewards that disagree) and ``4 p (1 - p)``
of the pass rate ``p`` (1 at p = 0.5, 0 at 0 or 1; the 4 scales it to [0, 1]). The first is what the
update actually trains on; the second is smoother on few groups. An environment without history yet
(iteration 0, or newly added) gets learnability 1: it is explored before it is judged. The floor keeps
every environment with weight > 0 in the mix (at least one problem per iteration when there are enough
problems), so a domain that looks hopeless now is still measured and can come back. Weight-0
environments stay evaluation-only.

Every iteration's mix (share, problems, pass rate, informative share, learnability, and why) is a row
per environment in the store's ``mix`` table, and curate's metrics carry ``mix_share_<env>`` to MLflow.
The history is the ``rollouts`` table and only earlier iterations count, so a rerun of curate makes the
same choice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from evertrain.config import CampaignConfig
from evertrain.data.store import now


@dataclass
class EnvMix:
    """One environment's place in one iteration's mix."""

    env: str
    weight: float
    share: float = 0.0
    problems: int = 0
    groups: int = 0
    pass_rate: float | None = None
    informative_share: float | None = None
    learnability: float = 1.0
    reason: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


def learnability(pass_rate: float | None, informative_share: float | None) -> float:
    """How much an environment can teach now, in [0, 1]: mean of informative-group share and 4p(1-p)."""
    if pass_rate is None or informative_share is None:
        return 1.0
    return 0.5 * (informative_share + 4.0 * pass_rate * (1.0 - pass_rate))


def shares(weights: list[float], learn: list[float], floor: float) -> list[float]:
    """Each environment's share: the floor for every environment with weight > 0, the rest by weight x
    learnability. Weight 0 stays 0. When nothing is learnable anywhere, the rest follows the weights."""
    active = [i for i, w in enumerate(weights) if w > 0]
    if not active:
        raise ValueError("the mix needs at least one environment with weight > 0")
    floor = min(floor, 1.0 / len(active))
    raw = [weights[i] * learn[i] if i in active else 0.0 for i in range(len(weights))]
    if sum(raw) <= 0:
        raw = [w if i in active else 0.0 for i, w in enumerate(weights)]
    total = sum(raw)
    rest = 1.0 - floor * len(active)
    return [floor + rest * raw[i] / total if i in active else 0.0 for i in range(len(weights))]


def counts(total: int, share: list[float]) -> list[int]:
    """Split ``total`` problems by ``share`` (largest remainder), with at least one for every environment
    with a share > 0 while ``total`` allows: the floor's promise that no domain is starved."""
    exact = [total * s for s in share]
    out = [int(x) for x in exact]
    order = sorted((i for i, s in enumerate(share) if s > 0), key=lambda i: exact[i] - out[i], reverse=True)
    for i in order[: total - sum(out)]:
        out[i] += 1
    for i in sorted((i for i, s in enumerate(share) if s > 0 and out[i] == 0), key=lambda i: -share[i]):
        donor = max(range(len(out)), key=lambda j: out[j])
        if out[donor] <= 1:
            break
        out[donor] -= 1
        out[i] += 1
    return out


def history(store: Any, campaign: str, iteration: int, window: int) -> dict[str, tuple[int, float, float]]:
    """Per environment over iterations [iteration - window, iteration): (groups, pass rate, informative share)."""
    return store.env_group_history(campaign, iteration - window, iteration)


def plan(config: CampaignConfig, store: Any, campaign: str, iteration: int) -> list[EnvMix]:
    """This iteration's mix: one :class:`EnvMix` per configured environment, in config order."""
    envs = [EnvMix(spec.name, spec.weight) for spec in config.environments]
    seen = history(store, campaign, iteration, config.mix.window) if config.mix.adaptive else {}
    for item in envs:
        if item.weight <= 0:
            item.learnability, item.reason = 0.0, "weight 0: evaluated only"
        elif not config.mix.adaptive:
            item.reason = "fixed weights (mix.adaptive = false)"
        elif item.env in seen:
            item.groups, item.pass_rate, item.informative_share = seen[item.env]
            item.learnability = learnability(item.pass_rate, item.informative_share)
            item.reason = (f"{item.groups} groups in the last {config.mix.window} iteration(s): pass rate "
                           f"{item.pass_rate:.2f}, informative {item.informative_share:.2f}")
        else:
            item.reason = "no scored rollouts yet: explored at learnability 1"
    floor = config.mix.floor if config.mix.adaptive else 0.0
    weights = [item.weight for item in envs]
    split = shares(weights, [item.learnability for item in envs], floor)
    numbers = counts(config.problems_per_iteration, split)
    for item, share, n in zip(envs, split, numbers, strict=True):
        item.share, item.problems = share, n
    return envs


def record(rt: Any, iteration: int) -> tuple[list[int], dict[str, Any]]:
    """Plan iteration ``iteration``'s mix, write it to the store's ``mix`` table (replacing a rerun's rows),
    and return the problem counts per environment (config order) and metrics for MLflow."""
    envs = plan(rt.config, rt.store, rt.campaign, iteration)
    stamp = now()
    rt.store.replace("mix", {"campaign": rt.campaign, "iteration": iteration},
                     [{"campaign": rt.campaign, "iteration": iteration, **item.row(), "created_at": stamp}
                      for item in envs])
    metrics: dict[str, Any] = {}
    for item in envs:
        metrics[f"mix_share_{item.env}"] = round(item.share, 4)
        metrics[f"mix_learnability_{item.env}"] = round(item.learnability, 4)
    return [item.problems for item in envs], metrics
