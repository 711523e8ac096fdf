"""vf-guess: a multi-turn verifiers (0.4.0, ``verifiers.v1``) environment written only against that package's public
API. The task hides an integer; the policy guesses, the environment answers "higher" or "lower" after each
wrong guess, for up to ``max_guesses`` guesses. The reward ``solved`` is 1 when the last guess is the number;
``efficiency`` (weight 0, a metric in all but name) is higher the fewer guesses it took."""

from vf_guess.env import GuessConfig, GuessEnv, GuessTaskset, feedback

__all__ = ["GuessEnv", "GuessTaskset"]  # one taskset and one environment: verifiers finds both through __all__
_ = (GuessConfig, feedback)
