"""Kernel-path switches read from the environment in one place."""

from __future__ import annotations

import pytest

from fgchat.protocol.tuning import DEFAULT_GEMV_MAX, Tuning


def test_defaults_without_environment(monkeypatch):
    for name in ("FGCHAT_FUSED", "FGCHAT_PDL", "FGCHAT_GEMV_MAX", "FGCHAT_FUSED_COMBINE"):
        monkeypatch.delenv(name, raising=False)
    t = Tuning.from_env()
    assert t == Tuning() and t.pdl and t.gemv_max_elements == DEFAULT_GEMV_MAX and not t.fused_combine
    assert t.changed() == {}


def test_environment_switches_and_changed(monkeypatch):
    monkeypatch.setenv("FGCHAT_PDL", "0")
    monkeypatch.setenv("FGCHAT_FUSED_COMBINE", "1")
    monkeypatch.setenv("FGCHAT_GEMV_MAX", "1e9")
    monkeypatch.setenv("FGCHAT_PIPELINE", "off")
    t = Tuning.from_env()
    assert not t.pdl and t.fused_combine and not t.pipeline and t.gemv_max_elements == 10**9
    assert t.changed() == {"pdl": False, "fused_combine": True, "pipeline": False, "gemv_max_elements": 10**9}


def test_unparsable_number_keeps_the_default(monkeypatch):
    monkeypatch.setenv("FGCHAT_GEMV_MAX", "lots")
    assert Tuning.from_env().gemv_max_elements == DEFAULT_GEMV_MAX


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


def test_l2_prefetch_budget_from_environment(monkeypatch):
    monkeypatch.setenv("FGCHAT_L2_PREFETCH_MB", "0")
    t = Tuning.from_env()
    assert t.l2_prefetch_mb == 0 and t.changed() == {"l2_prefetch_mb": 0}
    monkeypatch.setenv("FGCHAT_L2_PREFETCH_MB", "32")
    assert Tuning.from_env().l2_prefetch_mb == 32


@pytest.mark.parametrize("var,field,default", [
    ("FGCHAT_ATTN_CUR_FROM_CACHE", "attention_cur_from_cache", False),
    ("FGCHAT_BOUND_ATTENTION", "bound_attention", True),
    ("FGCHAT_EAGER_LAUNCH_LIST", "eager_launch_list", True),
])
def test_boolean_switch(monkeypatch, var, field, default):
    monkeypatch.delenv(var, raising=False)
    assert getattr(Tuning.from_env(), field) is default
    monkeypatch.setenv(var, "0" if default else "1")
    t = Tuning.from_env()
    assert getattr(t, field) is (not default) and t.changed() == {field: not default}
