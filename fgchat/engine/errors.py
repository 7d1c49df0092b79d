"""User-facing errors: each carries one line that the CLI or UI prints as is."""


class FgchatError(Exception):
    """An error caused by user input or environment; its message is one clear line."""


class ModelLoadError(FgchatError):
    """The model could not be found, read or understood."""


class RequestError(FgchatError):
    """A request is invalid (prompt too long, bad sampling values)."""
