"""Start-up check time per starting mode (CUDA): python3 tools/time_startup_check.py"""
from fgchat.protocol.config import EngineConfig
from fgchat.engine.core import Engine
for mode in ("eager", "full"):
    e = Engine(EngineConfig(preset="llama-3.2-1b", mode=mode, max_context=1024))
    print(mode, e.startup_check)
