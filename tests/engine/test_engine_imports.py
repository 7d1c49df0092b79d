"""What importing the engine costs: none of its modules may import torch._dynamo (seconds of
start-up: ~5 s on a GPU host), which some torch modules pull in at import
(torch.nn.attention.bias, for one)."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = ["fgchat.engine.core", "fgchat.engine.process", "fgchat.engine.loader",
                  "fgchat.engine.modes", "fgchat.engine.model.prefill", "fgchat.engine.model.decoder",
                  "fgchat.engine.launch_list", "fgchat.engine.prefix_reuse"]

SCRIPT = "import importlib, sys\n" \
         f"for m in {ENGINE_MODULES!r}:\n" \
         "    importlib.import_module(m)\n" \
         "print(sorted(m for m in sys.modules if m == 'torch._dynamo' or m.startswith('torch._dynamo.'))[:3])\n"


def test_importing_the_engine_does_not_import_torch_dynamo():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
