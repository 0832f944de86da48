"""Exceptions raised by linicl. All are ValueErrors, so ``except ValueError`` keeps working."""


class LiniclError(ValueError):
    """Base class: bad input to a linicl function, with a message that names the argument."""


class ConfigError(LiniclError):
    """A ModelConfig field has an invalid value or an inconsistent combination."""


class NotExactError(LiniclError):
    """An exact-only routine was given a model for which the identity does not hold (e.g. softmax)."""


class SequenceTooLongError(LiniclError):
    """Tokens would be placed past the model's maximum position (learned positions, decode cache)."""


class DegenerateInputError(LiniclError):
    """A theory formula would divide by (nearly) zero for this input."""


class BudgetError(LiniclError):
    """A selection's budget (``keep``) cannot hold what every selection stores: the kernel terms, or
    the sinks and the window of every head."""


class DataError(LiniclError):
    """A data or checkpoint directory, file or line is missing or malformed; the message names the path
    and the fix."""
