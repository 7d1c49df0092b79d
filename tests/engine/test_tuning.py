"""Kernel-path switches read from the environment in one place."""

from __future__ import annotations

import pytest

from fgchat.protocol.errors import FgchatError
from fgchat.protocol.tuning import Tuning


def test_defaults_without_environment(monkeypatch):
    for name in ("FGCHAT_FUSED", "FGCHAT_PDL", "FGCHAT_PIPELINE", "FGCHAT_L2_PREFETCH_MB"):
        monkeypatch.delenv(name, raising=False)
    t = Tuning.from_env()
    assert t == Tuning() and t.pdl and t.fused and t.pipeline is None and t.l2_prefetch_mb == 16
    assert t.changed() == {}


def test_environment_switches_and_changed(monkeypatch):
    monkeypatch.setenv("FGCHAT_PDL", "0")
    monkeypatch.setenv("FGCHAT_GEMV", "no")
    monkeypatch.setenv("FGCHAT_PIPELINE", "off")
    t = Tuning.from_env()
    assert not t.pdl and not t.gemv and t.pipeline is False
    assert t.changed() == {"pdl": False, "gemv": False, "pipeline": False}


def test_retired_switches_are_not_read(monkeypatch):
    """Variables of variants the notes measured and retired change nothing."""
    for var in ("FGCHAT_FUSED_COMBINE", "FGCHAT_GEMV_MAX", "FGCHAT_BOUND_ATTENTION", "FGCHAT_GLU",
                "FGCHAT_PREFILL_REPLAY", "FGCHAT_ATTN_PRELOAD", "FGCHAT_GRAPH_REUPLOAD"):
        monkeypatch.setenv(var, "0")
    assert Tuning.from_env() == Tuning()


def test_projection_config_overrides_per_role(monkeypatch):
    monkeypatch.setenv("FGCHAT_PROJ_CONFIGS", " gate_up=64,128,4,4 ; qkv=32,256,4,3,1;")
    t = Tuning.from_env()
    assert t.proj_config_texts() == {"gate_up": "64,128,4,4", "qkv": "32,256,4,3,1"}
    assert t.changed() == {"proj_configs": "gate_up=64,128,4,4 ; qkv=32,256,4,3,1;"}


def test_malformed_projection_config_is_one_user_error():
    pytest.importorskip("triton")  # the fused stages import the Triton kernels
    from fgchat.protocol.errors import FgchatError
    from fgchat.engine.model.fused_step import _configs

    for bad, match in (("lm=64,128,4,4", "ROLE"), ("gate_up=64,128", "bn,bk"), ("gate_up", "ROLE")):
        with pytest.raises(FgchatError, match=match):
            _configs(Tuning(proj_configs=bad))


def test_projection_preload_from_environment(monkeypatch):
    from fgchat.protocol.errors import FgchatError

    assert Tuning.from_env().proj_preload == 2
    monkeypatch.setenv("FGCHAT_PROJ_PRELOAD", "1")
    t = Tuning.from_env()
    assert t.proj_preload == 1 and t.changed() == {"proj_preload": 1}
    for bad in ("3", "0", "two"):
        monkeypatch.setenv("FGCHAT_PROJ_PRELOAD", bad)
        with pytest.raises(FgchatError, match="FGCHAT_PROJ_PRELOAD"):
            Tuning.from_env()


def test_l2_prefetch_budget_from_environment(monkeypatch):
    monkeypatch.setenv("FGCHAT_L2_PREFETCH_MB", "0")
    t = Tuning.from_env()
    assert t.l2_prefetch_mb == 0 and t.changed() == {"l2_prefetch_mb": 0}
    monkeypatch.setenv("FGCHAT_L2_PREFETCH_MB", "32")
    assert Tuning.from_env().l2_prefetch_mb == 32


@pytest.mark.parametrize("var,field,default", [
    ("FGCHAT_RESIDUAL_FP32", "residual_fp32", True),
    ("FGCHAT_PREFILL_GRAPHS", "prefill_graphs", True),
    ("FGCHAT_EAGER_LAUNCH_LIST", "eager_launch_list", True),
    ("FGCHAT_CPU_MALLOC", "cpu_malloc", True),
    ])
def test_boolean_switch(monkeypatch, var, field, default):
    monkeypatch.delenv(var, raising=False)
    assert getattr(Tuning.from_env(), field) is default
    monkeypatch.setenv(var, "0" if default else "1")
    t = Tuning.from_env()
    assert getattr(t, field) is (not default) and t.changed() == {field: not default}


def test_head_pick_switch_has_three_states(monkeypatch):
    """Unset: the default (on, on CUDA only where it pays); 1 forces every batch and head; 0 off."""
    monkeypatch.delenv("FGCHAT_HEAD_PICK", raising=False)
    assert Tuning.from_env().head_pick is None and Tuning.from_env().changed() == {}
    monkeypatch.setenv("FGCHAT_HEAD_PICK", "1")
    t = Tuning.from_env()
    assert t.head_pick is True and t.changed() == {"head_pick": True}
    monkeypatch.setenv("FGCHAT_HEAD_PICK", "0")
    t = Tuning.from_env()
    assert t.head_pick is False and t.changed() == {"head_pick": False}


@pytest.mark.parametrize("raw,value", [("1", True), ("on", True), ("YES", True), ("true", True),
                                       ("0", False), ("off", False), ("No", False), ("false", False)])
def test_switches_take_the_usual_spellings(monkeypatch, raw, value):
    monkeypatch.setenv("FGCHAT_FUSED", raw)
    monkeypatch.setenv("FGCHAT_HEAD_PICK", raw)
    t = Tuning.from_env()
    assert t.fused is value and t.head_pick is value


@pytest.mark.parametrize("name,raw", [("FGCHAT_HEAD_PICK", "maybe"), ("FGCHAT_FUSED", "nope"),
                                      ("FGCHAT_PREFIX_REUSE", "2"), ("FGCHAT_L2_PREFETCH_MB", "inf"),
                                      ("FGCHAT_L2_PREFETCH_MB", "-5"), ("FGCHAT_L2_PREFETCH_MB", "abc"),
                                      ("FGCHAT_L2_PREFETCH_MB", "nan")])
def test_a_malformed_switch_is_a_one_line_error_naming_it(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(FgchatError) as err:
        Tuning.from_env()
    assert name in str(err.value) and repr(raw) in str(err.value) and "\n" not in str(err.value)


def test_counts_and_unset_switches(monkeypatch):
    monkeypatch.setenv("FGCHAT_L2_PREFETCH_MB", "0")
    monkeypatch.setenv("FGCHAT_PREFIX_REUSE", " ")
    t = Tuning.from_env()
    assert t.l2_prefetch_mb == 0 and t.prefix_reuse is None


def test_the_engine_process_reads_the_switches_before_it_starts_a_child(monkeypatch, tiny_llama):
    from fgchat.engine.process import EngineProcess
    from fgchat.protocol.config import EngineConfig

    monkeypatch.setenv("FGCHAT_HEAD_PICK", "maybe")
    with pytest.raises(FgchatError, match="FGCHAT_HEAD_PICK"):
        EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu"))
    monkeypatch.delenv("FGCHAT_HEAD_PICK")
    proc = EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu"))
    assert proc.pid is None and proc.config.tuning.idle_capture, "the child runs what was read here"
