"""The learner (the GRPO loss and train step, the data-parallel update, training log-probs) and the model files
it shares with inference (checkpoints, precision, the shared forward pass, the embedded models).

:class:`ModelError` is the package's one error: a model, checkpoint or precision that cannot be used; its message
names the path or setting.
"""


class ModelError(RuntimeError):
    """A model or checkpoint that cannot be loaded, or a precision the device lacks; the message names which."""
