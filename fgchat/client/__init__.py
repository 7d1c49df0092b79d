"""A client handle for OpenAI-compatible servers with EngineProcess's interface.

`EndpointClient` lets the TUI and the bench drive a remote server (fgchat serve, vLLM, SGLang, ...)
exactly as they drive the local engine; timings are measured at the client.
"""

from fgchat.client.handle import EndpointClient

__all__ = ["EndpointClient"]
