"""Which dtype the engine and the command line pick (devices.pick_dtype, cli --dtype)."""

import pytest
import torch

from fgchat.cli import build_parser
from fgchat.engine import devices
from fgchat.protocol.errors import FgchatError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_on_cpus_with_bf16_instructions(monkeypatch, native):
    monkeypatch.setattr(devices, "cpu_computes_bf16", lambda: native)
    assert devices.pick_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    assert devices.pick_dtype("auto", CUDA) == torch.bfloat16
    # the engine's own default stays the float32 reference on CPU
    assert devices.pick_dtype(None, CPU) == torch.float32
    assert devices.pick_dtype(None, CUDA) == torch.bfloat16
    assert devices.pick_dtype("fp32", CPU) == torch.float32
    with pytest.raises(FgchatError):
        devices.pick_dtype("int8", CPU)


def test_cpu_probe_false_when_torch_cannot_tell(monkeypatch):
    def broken():
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", broken, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert devices.cpu_computes_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert devices.cpu_computes_bf16() is True


@pytest.mark.parametrize("argv", [[], ["generate", "--prompt", "hi"], ["serve"], ["bench"]])
def test_command_line_default_is_auto(argv):
    assert build_parser().parse_args(argv).dtype == "auto"


def test_endpoint_accepts_the_default_dtype_and_refuses_a_chosen_one():
    from fgchat.client.tui import check_endpoint_args

    parser = build_parser()
    check_endpoint_args(parser.parse_args(["--endpoint", "http://127.0.0.1:9/v1"]))
    with pytest.raises(FgchatError, match="--dtype"):
        check_endpoint_args(parser.parse_args(["--endpoint", "http://127.0.0.1:9/v1", "--dtype", "bf16"]))
