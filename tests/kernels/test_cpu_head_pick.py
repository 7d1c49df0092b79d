"""The CPU greedy pick from a packed bf16 copy of the LM head (model.cpu_head_pick) against float64
arithmetic on the head's own weights, and in a CPU engine against the exact head."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.model.cpu_head_pick import CpuHeadPick


def _pick(w: torch.Tensor) -> CpuHeadPick:
    p = CpuHeadPick.prepare(w)
    if p is None:
        pytest.skip("no native bf16 / oneDNN packed bf16 product on this CPU")
    return p


def _head(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5 * (torch.rand(n, 1, generator=g) + 0.5)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 8])
def test_pick_is_the_first_maximum_of_the_exact_logits(dtype, m):
    n, k = 5000, 256
    w = _head(n, k, m, dtype)
    g = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    w[4000] = w[1234]  # a duplicate of row 0's winner below: the first index must win
    x[0] = (w[1234].float() * 30).to(dtype)
    w[2001] = (w[2000].float() * (1 + 2**-9)).to(dtype)  # a near tie inside bf16's rounding
    if m > 1:
        x[1] = (w[2000].float() * 30).to(dtype)
    logits, tokens = _pick(w).pick(x)
    exact = x.double() @ w.double().T
    assert torch.equal(tokens, exact.argmax(dim=1))
    assert int(tokens[0]) == 1234
    close = (logits.double() - exact).abs() <= 1e-5 * exact.abs().max()
    assert close[torch.arange(m), tokens].all()  # the winners' logits are float32 sums
    rescored = logits != logits.bfloat16().float()  # the rest are bf16 values
    assert 0 < rescored.any(dim=0).sum() < n // 100  # few rows read at full precision
    assert ((logits.double() - exact).abs() <= 2**-7 * exact.abs().max() + 1e-3).all()


def test_pick_on_nan_rows_matches_argmax():
    w = _head(300, 64, 1, torch.bfloat16)
    x = torch.randn(2, 64).bfloat16()
    x[1, 3] = float("nan")
    logits, tokens = _pick(w).pick(x)
    assert int(tokens[0]) == int((x[:1].double() @ w.double().T).argmax())
    assert torch.isnan(logits[1]).any()


def test_no_pick_without_native_bf16(monkeypatch):
    from fgchat.engine import devices

    monkeypatch.setattr(devices, "cpu_computes_bf16", lambda: False)
    assert CpuHeadPick.prepare(_head(64, 64, 0, torch.bfloat16)) is None


def _engine(model, pick: bool):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    return Engine(EngineConfig(model=str(model), device="cpu", max_context=128, dtype="bfloat16",
                               tuning=Tuning(head_pick=pick)))


def test_engine_picks_the_exact_heads_tokens(tiny_llama, monkeypatch):
    from fgchat.protocol.events import RequestFinished, SamplingParams

    eng_pick, eng_exact = _engine(tiny_llama, True), _engine(tiny_llama, False)
    if not eng_pick.decoder.picks_approximately:
        pytest.skip("no CPU head pick on this machine")
    assert not eng_exact.decoder.picks_approximately
    assert eng_pick.startup_check is not None and eng_pick.startup_check.passed
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, eng_pick.cfg.vocab_size, (7 + 9 * i,), generator=g).tolist() for i in range(3)]
    outs = []
    for eng in (eng_pick, eng_exact):
        for p in prompts:
            eng.submit(p, SamplingParams(max_tokens=20, ignore_eos=True))
        events = []
        while eng.has_work():
            events += eng.step()
        outs.append(sorted(e.summary.token_ids for e in events if isinstance(e, RequestFinished)))
    assert outs[0] == outs[1] and len(outs[0]) == 3


def test_startup_check_catches_a_wrong_cpu_pick(tiny_llama, monkeypatch):
    from fgchat.engine import startup_check

    eng = _engine(tiny_llama, True)
    if not eng.decoder.picks_approximately:
        pytest.skip("no CPU head pick on this machine")
    good = CpuHeadPick.pick

    def off_by_one(self, x):
        logits, tokens = good(self, x)
        return logits, (tokens + 1) % logits.shape[1]

    monkeypatch.setattr(CpuHeadPick, "pick", off_by_one)
    result = startup_check.run(eng)
    assert not result.passed and "top-1" in result.message


def test_bounds_do_not_depend_on_the_rows_per_pass():
    w = _head(1000, 128, 7, torch.float16)
    whole = _pick(w)
    chunked = CpuHeadPick(w, w.to(torch.bfloat16), whole.packed, rows=96)
    assert (chunked.max_err, chunked.max_norm) == (whole.max_err, whole.max_norm)


def test_no_pick_past_the_memory_share(monkeypatch):
    from fgchat.engine.model import cpu_head_pick

    monkeypatch.setattr(cpu_head_pick, "physical_memory_bytes", lambda: 4 * 64 * 64 * 2 - 1)
    assert CpuHeadPick.prepare(_head(64, 64, 0, torch.bfloat16)) is None
