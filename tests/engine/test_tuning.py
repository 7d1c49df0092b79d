"""The switches the environment sets, read in one place."""

from __future__ import annotations

import pytest

from fgchat.protocol.errors import FgchatError
from fgchat.protocol.tuning import Tuning


def test_defaults_without_environment(monkeypatch):
    for name in ("FGCHAT_FUSED", "FGCHAT_PROJ_CONFIGS"):
        monkeypatch.delenv(name, raising=False)
    t = Tuning.from_env()
    assert t == Tuning() and t.fused and t.proj_configs == "" and t.head_pick is None
    assert t.changed() == {}


def test_environment_switches_and_changed(monkeypatch):
    monkeypatch.setenv("FGCHAT_FUSED", "0")
    t = Tuning.from_env()
    assert not t.fused and t.changed() == {"fused": False}


def test_retired_switches_are_not_read(monkeypatch):
    """Variables of variants that lost (or won and became the code) change nothing."""
    for var in ("FGCHAT_PDL", "FGCHAT_GEMV", "FGCHAT_TMA", "FGCHAT_PIECEWISE_O", "FGCHAT_PROJ_PRELOAD",
                "FGCHAT_L2_PREFETCH_MB", "FGCHAT_L2_PREFETCH_LEAD", "FGCHAT_PIECEWISE_PREFETCH",
                "FGCHAT_RESIDUAL_FP32", "FGCHAT_PIPELINE", "FGCHAT_PREFILL_GRAPHS", "FGCHAT_EAGER_LAUNCH_LIST",
                "FGCHAT_BATCHED_PREFILL", "FGCHAT_PREFILL_BATCH_ROUTE", "FGCHAT_RECAPTURE_DECODE",
                "FGCHAT_IDLE_CAPTURE", "FGCHAT_HEAD_SAMPLE", "FGCHAT_HEAD_PICK", "FGCHAT_CPU_PACKED",
                "FGCHAT_CPU_MALLOC", "FGCHAT_CPU_COMPILE", "FGCHAT_CPU_GEMM_TEMPLATES", "FGCHAT_CPU_ATTN_HALF",
                "FGCHAT_PREFIX_REUSE"):
        monkeypatch.setenv(var, "0")
    assert Tuning.from_env() == Tuning()


def test_fields_the_environment_does_not_set_come_from_the_defaults_given():
    base = Tuning(idle_capture=True, prefix_reuse=True, head_pick=False)
    assert Tuning.from_env(base) == base


def test_projection_config_overrides_per_role(monkeypatch):
    monkeypatch.setenv("FGCHAT_PROJ_CONFIGS", " gate_up=64,128,4,4 ; qkv=32,256,4,3,1;")
    t = Tuning.from_env()
    assert t.proj_config_texts() == {"gate_up": "64,128,4,4", "qkv": "32,256,4,3,1"}
    assert t.changed() == {"proj_configs": "gate_up=64,128,4,4 ; qkv=32,256,4,3,1;"}


def test_malformed_projection_config_is_one_user_error():
    pytest.importorskip("triton")  # the fused stages import the Triton kernels
    from fgchat.engine.model.fused_step import _configs

    for bad, match in (("lm=64,128,4,4", "ROLE"), ("gate_up=64,128", "bn,bk"), ("gate_up", "ROLE"),
                       ("o=32,256,4,3,1,4,4", "bn,bk"), ("o=32,256,4,3,1,1", "split 0 or at least 2")):
        with pytest.raises(FgchatError, match=match):
            _configs(Tuning(proj_configs=bad))


@pytest.mark.parametrize("raw,value", [("1", True), ("on", True), ("YES", True), ("true", True),
                                       ("0", False), ("off", False), ("No", False), ("false", False)])
def test_switches_take_the_usual_spellings(monkeypatch, raw, value):
    monkeypatch.setenv("FGCHAT_FUSED", raw)
    assert Tuning.from_env().fused is value


@pytest.mark.parametrize("raw", ["maybe", "nope", "2"])
def test_a_malformed_switch_is_a_one_line_error_naming_it(monkeypatch, raw):
    monkeypatch.setenv("FGCHAT_FUSED", raw)
    with pytest.raises(FgchatError) as err:
        Tuning.from_env()
    assert "FGCHAT_FUSED" in str(err.value) and repr(raw) in str(err.value) and "\n" not in str(err.value)


def test_the_engine_process_reads_the_switches_before_it_starts_a_child(monkeypatch, tiny_llama):
    from fgchat.engine.process import EngineProcess
    from fgchat.protocol.config import EngineConfig

    monkeypatch.setenv("FGCHAT_FUSED", "maybe")
    with pytest.raises(FgchatError, match="FGCHAT_FUSED"):
        EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu"))
    monkeypatch.delenv("FGCHAT_FUSED")
    proc = EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu"))
    assert proc.pid is None and proc.config.tuning.idle_capture, "the child runs what was read here"
