"""User-facing errors: each carries one line that the CLI or UI prints as is."""


class FgchatError(Exception):
    """An error caused by user input or environment; its message is one clear line."""


class ModelLoadError(FgchatError):
    """The model could not be found, read or understood."""


class RequestError(FgchatError):
    """A request is invalid (prompt too long, bad sampling values)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` means an allocation failed: MemoryError, torch.OutOfMemoryError (CUDA), or the
    RuntimeError torch's CPU allocator raises ("DefaultCPUAllocator: not enough memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "DefaultCPUAllocator" in text or "not enough memory" in text or "out of memory" in text.lower()
    return False


def error_line(exc: BaseException) -> str:
    """`exc` as one line of at most 300 characters (its type's name when it has no message)."""
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]
