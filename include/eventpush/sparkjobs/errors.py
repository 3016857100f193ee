"""The Spark jobs' setup error, below both halves of the setup (``session`` and ``pyenv``)."""


class SparkSetupError(RuntimeError):
    """Spark cannot be set up as asked; the message says what to fix."""
