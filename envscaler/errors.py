"""Errors raised by the core. Each message says what went wrong and where."""


class EnvScalerError(Exception):
    """Base of every error this package raises on purpose."""


class BundleError(EnvScalerError):
    """A bundle or import file is malformed: the message names the file and the field."""


class EnvCodeError(EnvScalerError):
    """Environment class code does not compile or does not define the class it names."""


class ChecklistError(EnvScalerError):
    """A scenario cannot be scored (for example, its checklist is empty or missing)."""
