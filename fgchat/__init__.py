"""fgchat: terminal chat and latency console for LLM inference."""

__version__ = "0.1.0"
