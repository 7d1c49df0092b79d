"""CPU checks of the decode-step bookkeeping that CUDA graphs rely on."""

from __future__ import annotations

import torch

from fgchat.engine.modes.base import StepMode
from fgchat.protocol.events import Mode

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.step import (MAX_ROWS, ROW_IDS, ROW_POS, ROW_SEED, ROW_SLOT, ROW_TEMP, ROW_TOPK, ROW_TOPP, StepBuffers,
                               Variant)


def test_stage_writes_lanes_and_zeroes_the_rest():
    bufs = StepBuffers(torch.device("cpu"), 4, 16, torch.float32)
    addr_i, addr_f = bufs.dev_i.data_ptr(), bufs.dev_f.data_ptr()
    bufs.stage([9] * 8, [5] * 8, list(range(8)), [1.0] * 8, [0.5] * 8, [3] * 8, [7] * 8)
    bufs.stage([11, 12], [40, 41], [6, 2], [0.0, 0.7], [1.0, 0.9], [0, 5], [1, 2])
    assert bufs.dev_i[ROW_IDS].tolist() == [11, 12] + [0] * (MAX_ROWS - 2)  # stale lanes cleared
    assert bufs.dev_i[ROW_POS, :2].tolist() == [40, 41]
    assert bufs.dev_i[ROW_SLOT, :2].tolist() == [6, 2]
    assert bufs.dev_i[ROW_TOPK, :2].tolist() == [0, 5]
    assert bufs.dev_i[ROW_SEED, :2].tolist() == [1, 2]
    assert torch.allclose(bufs.dev_f[ROW_TEMP, :2], torch.tensor([0.0, 0.7]))
    assert torch.allclose(bufs.dev_f[ROW_TOPP, :2], torch.tensor([1.0, 0.9]))
    assert (bufs.dev_f[:, 2:] == 0).all()
    # fixed addresses: graphs captured over these buffers stay valid
    assert bufs.dev_i.data_ptr() == addr_i and bufs.dev_f.data_ptr() == addr_f


def test_program_has_one_piece_per_attention_gap(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    for b in (1, 3, 8):
        pieces, attends = eng.program.pieces(b, variant=Variant.GREEDY)
        assert len(pieces) == eng.cfg.num_layers + 1 and len(attends) == eng.cfg.num_layers


def test_before_layer_runs_in_the_piece_that_ends_at_that_layers_attention(tiny_llama):
    """pieces(before_layer=...) calls it once per layer, in the piece before that layer's
    attention and before the layer's first stage; the step's results are the same."""
    from fgchat.engine.step import StepState

    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    eng.bufs.stage([5, 6], [3, 9], [1, 2], [0.0] * 2, [1.0] * 2, [0] * 2, [0] * 2)
    eng.program.max_len_hint = 10
    seen: list[tuple[int, int, bool]] = []  # (piece, layer, its K/V written yet)
    piece_no = [0]

    def before(i: int) -> None:
        seen.append((piece_no[0], i, bool(eng.cache.k[i][1, 3].abs().sum() > 0)))

    for t in eng.cache.k + eng.cache.v:
        t.zero_()
    plain = eng.program.run_eager(2, variant=Variant.GREEDY).logits.clone()
    for t in eng.cache.k + eng.cache.v:
        t.zero_()
    pieces, attends = eng.program.pieces(2, Variant.GREEDY, before)
    st = StepState()
    for j, piece in enumerate(pieces):
        piece_no[0] = j
        piece(st)
        if j < len(attends):
            attends[j](st)
    n = eng.cfg.num_layers
    assert seen == [(i, i, False) for i in range(n)]  # before the layer wrote its K/V
    assert torch.equal(st.logits, plain)


def test_step_derives_lengths_and_slots_on_device(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    for t in eng.cache.k + eng.cache.v:  # synthetic lengths: attention reads unwritten positions
        t.zero_()
    eng.bufs.stage([5, 6, 7], [10, 20, 30], [4, 0, 7], [0.0] * 3, [1.0] * 3, [0] * 3, [0] * 3)
    eng.program.max_len_hint = 31
    out = eng.program.run_eager(3, variant=Variant.GREEDY)
    assert eng.bufs.dev_i32[0, :3].tolist() == [11, 21, 31]  # seq_lens = position + 1
    assert eng.bufs.dev_i32[1, :3].tolist() == [4, 0, 7]
    assert out.tokens.shape == (3,) and out.logits.shape == (3, eng.cfg.vocab_size)
    # the step wrote this token's K/V at (slot, position) of every layer
    for layer in range(eng.cfg.num_layers):
        assert eng.cache.k[layer][4, 10].abs().sum() > 0 and eng.cache.v[layer][7, 30].abs().sum() > 0
        assert eng.cache.k[layer][4, 11].abs().sum() == 0  # nothing beyond the token's position


def test_mode_selection_on_cpu_reports_reasons(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128, mode="eager"))
    assert eng.modes.cap is None and set(eng.modes.modes) == {"eager"}
    for mode in ("piecewise", "full"):
        ev = eng.set_mode(mode)
        assert ev.mode == "eager" and "CUDA" in ev.reason
    assert eng.set_mode("eager").reason == ""
    assert eng.info().available_modes["eager"] == ""


class _OomMode(StepMode):
    """Stands in for a graph mode on CPU: every capture runs out of device memory."""

    mode = Mode.FULL

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def has(self, b: int, variant: int) -> bool:
        return False

    def capture(self, b: int, variant: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def run(self, b: int, variant: int):
        raise AssertionError("a mode that never captured must not run")

    def drop(self) -> None:
        self.dropped += 1


def test_out_of_memory_while_capturing_disables_the_mode(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    oom = _OomMode()
    eng.modes.install(Mode.FULL, oom)
    eng.modes._capture_mode(Mode.FULL, self_check=True)
    assert oom.dropped == 1
    assert "out of GPU memory" in eng.info().available_modes["full"]
    assert any("full disabled" in n for n in eng.info().notes)
    ev = eng.set_mode("full")
    assert ev.mode == "eager" and "out of GPU memory" in ev.reason
    from fgchat.protocol.events import SamplingParams

    eng.submit([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert sum(1 for e in eng.run_until_done() if type(e).__name__ == "TokenEvent") == 4


def test_out_of_memory_during_a_lazy_capture_falls_back_to_eager(tiny_llama):
    """A capture on first use that runs out of memory: the step runs eagerly, the engine says
    so (ModeChanged, then EngineInfo with the reason) and stays in eager."""
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    eng.modes.install(Mode.FULL, _OomMode())
    assert eng.set_mode("full").mode == "full"
    from fgchat.protocol.events import EngineInfo, ModeChanged, SamplingParams, TokenEvent

    eng.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    events = eng.run_until_done()
    assert sum(isinstance(e, TokenEvent) for e in events) == 3
    assert all(e.mode == "eager" for e in events if isinstance(e, TokenEvent))
    changed = [e for e in events if isinstance(e, ModeChanged)]
    assert changed and changed[-1].mode == "eager" and "out of GPU memory" in changed[-1].reason
    infos = [e for e in events if isinstance(e, EngineInfo)]
    assert infos and "out of GPU memory" in infos[-1].available_modes["full"] and eng.mode == "eager"
