"""vf-sums: a verifiers (0.4.0, ``verifiers.v1``) taskset written only against that package's public API.

Each task asks for the sum of a few small integers (generated from a seed: no data set, nothing downloaded);
the one reward, ``correct``, is 1 when the reply's only ``\\boxed{...}`` holds the sum exactly. Load it with
``verifiers.load_taskset(verifiers.taskset_config_type("vf-sums")(id="vf-sums"))``, or train on it with
evertrain (``name = "verifiers:vf-sums"``).
"""

from vf_sums.taskset import SumsConfig, SumsData, SumsTask, SumsTaskset

# the package's own curriculum, easiest first: each level's SumsConfig fields over the configured ones (a literal,
# so a trainer can read it without running this package's code: evertrain's verifiers adapter does)
CURRICULUM = [
    {"terms": 2, "digits": 1},
    {"terms": 3, "digits": 1},
    {"terms": 2, "digits": 2},
    {"terms": 3, "digits": 2},
]

__all__ = ["SumsTaskset"]  # verifiers finds the taskset class through __all__
_ = (SumsConfig, SumsData, SumsTask)
