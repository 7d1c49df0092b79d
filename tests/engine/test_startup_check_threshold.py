"""The start-up check's error threshold: a fault that keeps top-1 and top-5 but moves one checked
position's logits by a few percent more than the dtype's noise must fail the check; the same fault
well inside the noise must pass. (FGCHAT_FAULT=startup-check rolls the logits: top-1 changes,
so it never exercised the threshold.)"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine import startup_check
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.tuning import Tuning

pytestmark = pytest.mark.timeout(120)


def scaled_production(monkeypatch, row: int, factor: float) -> None:
    """production_logits with logits row `row` (0: the prompt's last position, 1: the decode step)
    multiplied by `factor`: the order of every logit (so top-1 and top-5) is kept, the relative
    error is |factor - 1|, and the other row is untouched."""
    real = startup_check.production_logits

    def scaled(engine, ids, nxt):
        logits, picked = real(engine, ids, nxt)
        logits = logits.clone()
        logits[row] *= factor
        return logits, picked

    monkeypatch.setattr(startup_check, "production_logits", scaled)


@pytest.fixture(scope="module")
def engine32(tiny_llama) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=128))


def test_the_unchanged_path_passes(engine32):
    result = startup_check.run(engine32)
    assert result.passed and result.max_rel_err < 0.002, result


@pytest.mark.parametrize("row", [0, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("factor, passes", [(1.03, False), (0.97, False), (1.004, True)])
def test_float32_a_few_percent_fails_top1_and_top5_kept(engine32, monkeypatch, row, factor, passes):
    scaled_production(monkeypatch, row, factor)
    result = startup_check.run(engine32)
    assert result.top1_equal and result.top5_overlap == 5, result
    assert result.max_rel_err == pytest.approx(abs(factor - 1), abs=0.002)
    assert result.passed is passes, result
    if not passes:
        assert "max relative error 0.03" in result.message and "top-5 overlap 5/5" in result.message


@pytest.mark.parametrize("factor, passes", [(1.2, False), (1.02, True)])
def test_bfloat16_engine_checks_at_start_and_fails_past_its_band(tiny_llama, monkeypatch, factor, passes):
    """In bf16 the check runs while the engine is built (on CPU too); 20% on the decode step's
    logits (order kept) is past bf16's band, 2% is inside it. A failure is the engine's note."""
    scaled_production(monkeypatch, 1, factor)
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_context=128,
                              tuning=Tuning(idle_capture=False)))
    result = eng.startup_check
    assert result is not None and result.top1_equal and result.top5_overlap == 5, result
    assert result.passed is passes, result
    assert any("startup check" in n for n in eng.notes) is not passes


def test_compare_measures_the_worst_position():
    ref = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))
    prod = ref.clone()
    prod[1] *= 1.05
    c = startup_check.compare(prod, ref, torch.float32)
    assert c.max_rel_err == pytest.approx(0.05, rel=1e-3) and c.top1_equal and c.top5_overlap == 5
    assert not c.agrees(torch.float32) and c.agrees(torch.bfloat16)
    prod[1] = ref[1] * 1.005
    assert startup_check.compare(prod, ref, torch.float32).agrees(torch.float32)
