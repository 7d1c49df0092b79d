"""Planning the L2 weight prefetch beside attention (CPU; the kernel itself runs in test_gpu_l2_prefetch)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # as test_gemv.py: kernels decorated from here on (pdl's, gemv's) must be the interpreter's
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fgchat.engine.kernels import l2_prefetch as lp  # noqa: E402


def test_plan_takes_whole_tensors_in_order_while_they_fit():
    o = torch.zeros(64, 2048, dtype=torch.bfloat16)  # 256 KiB: 64 chunks
    gu = torch.zeros(256, 2048, dtype=torch.bfloat16)  # 1 MiB: 256 chunks
    down = torch.zeros(16, 2048, dtype=torch.bfloat16)  # 64 KiB
    both = [lp.Range(o.data_ptr(), 64), lp.Range(gu.data_ptr(), 256)]
    assert lp.plan([o, gu], 10 * 2**20) == both
    assert lp.plan([o, gu], (64 + 256) * lp.CHUNK) == both
    # gate/up does not fit whole: the plan ends there, even though down would fit
    assert lp.plan([o, gu, down], 100 * lp.CHUNK) == [lp.Range(o.data_ptr(), 64)]
    assert lp.plan([o, gu], 64 * lp.CHUNK - 1) == []


def test_plan_leaves_out_tails_and_views_but_counts_their_bytes():
    t = torch.zeros(lp.CHUNK * 3 + 100, dtype=torch.uint8)
    assert lp.plan([t], 2**30) == [lp.Range(t.data_ptr(), 3)]  # the 100-byte tail is left out
    strided = torch.zeros(64, 4096, dtype=torch.bfloat16)[:, ::2]
    odd = t[1:]
    assert odd.data_ptr() % 16
    assert lp.plan([strided, odd], 2**30) == []
    # a skipped view still uses its share of the budget
    assert lp.plan([strided, t], strided.numel() * 2 + lp.CHUNK) == []


def test_supported_needs_cuda():
    assert not lp.supported(torch.device("cpu"))


def test_each_layer_prefetches_the_next_layers_qkv_where_its_own_weights_fit(monkeypatch):
    """Beside layer i's attention: its o, gate/up and down, then layer i+1's qkv (SmolLM2's shapes,
    all within 16 MiB); the last layer has no next qkv. 1B's gate/up does not fit: o alone."""
    monkeypatch.setattr(lp, "supported", lambda device: True)

    def chunks(t: torch.Tensor) -> int:
        return t.numel() * t.element_size() // lp.CHUNK

    st = _stages(576, 1536, 960, 3)
    ls = st.dec.w.layers
    for i, ranges in enumerate(st.prefetch):
        want = [ls[i].wo, ls[i].w_gate_up, ls[i].w_down] + ([ls[i + 1].wqkv] if i + 1 < len(ls) else [])
        assert [(r.addr, r.chunks) for r in ranges] == [(t.data_ptr(), chunks(t)) for t in want]
    st = _stages(2048, 8192, 3072, 2)
    assert [[r.addr for r in ranges] for ranges in st.prefetch] == [[lw.wo.data_ptr()] for lw in st.dec.w.layers]


def test_piecewise_prefetches_by_default_only_where_every_layers_weights_fit(monkeypatch):
    """SmolLM2's layers (o, gate/up, down within 16 MiB) are latency-bound, so piecewise graphs
    prefetch too; 1B's plan is o alone (gate/up 32 MiB), and one layer too large anywhere turns it
    off."""
    monkeypatch.setattr(lp, "supported", lambda device: True)
    assert _stages(576, 1536, 960, 2).layers_fit
    assert not _stages(2048, 8192, 3072, 1).layers_fit
    assert _stages(576, 1536, 960, 1, mb=6).layers_fit
    assert not _stages(576, 1536, 960, 1, mb=5).layers_fit  # 0.6 + 3.4 + 1.7 MiB
    assert not _stages(576, 1536, 960, 1, mb=0).layers_fit


def test_leading_tiles_take_whole_tiles_of_every_row_up_to_half_the_columns():
    w = torch.zeros(16, 1024, dtype=torch.bfloat16)  # rows of 2 KiB; a 256-column tile is 512 B a row
    assert lp.leading_tiles(w, 256, 20 * 1024) == lp.Rows(w.data_ptr(), 16, 2048, 1024)  # 2 of 4 tiles: the cap
    assert lp.leading_tiles(w, 256, 8 * 1024) == lp.Rows(w.data_ptr(), 16, 2048, 512)
    assert lp.leading_tiles(w, 256, 8 * 1024 - 1) is None  # not one tile of every row
    assert lp.leading_tiles(torch.zeros(16, 2048, dtype=torch.bfloat16)[:, ::2], 256, 2**20) is None
    assert lp.fitting([w, w, w], 2 * w.numel() * 2 + 5) == [w, w]  # two whole weights take the budget


def test_lead_tiles_join_the_prefetch_where_gate_up_does_not_fit(monkeypatch):
    """On 1B's shapes o fits 16 MiB whole, then gate/up's leading 256-column tiles fill what
    LEAD_BUDGET_MB (32) leaves: three; a 48 MiB budget gives four, half of K (the cap). 8B's o does
    not fit 16 MiB: no tiles (at 48 MiB o fits, and its 128-column tiles take the 16 MiB left: two
    of 7 MiB). SmolLM2's gate/up fits whole: no tiles. Off: none."""
    from fgchat.protocol.tuning import Tuning

    monkeypatch.setattr(lp, "supported", lambda device: True)

    def lead(hidden: int, inter: int, q: int, mb: int = 16, on: bool | None = None):
        st = _stages(hidden, inter, q, 1, Tuning(l2_prefetch_lead=on), mb=mb)
        return st.lead[0] if st.lead is not None else None, st.dec.w.layers[0]

    rows, lw = lead(2048, 8192, 3072)
    assert rows == lp.Rows(lw.w_gate_up.data_ptr(), 16384, 4096, 3 * 512)
    rows, lw = lead(2048, 8192, 3072, mb=48)
    assert rows == lp.Rows(lw.w_gate_up.data_ptr(), 16384, 4096, 4 * 512)
    assert lead(4096, 14336, 6144)[0] is None
    rows, lw = lead(4096, 14336, 6144, mb=48)
    assert rows == lp.Rows(lw.w_gate_up.data_ptr(), 28672, 8192, 2 * 256)
    assert lead(576, 1536, 960)[0] is None
    assert lead(2048, 8192, 3072, on=False)[0] is None


def test_lead_tiles_go_to_graphs_of_four_rows_and_more_unless_forced(monkeypatch):
    """side_work(rows)(i) issues layer i's whole ranges, and its gate/up tiles in graphs of
    LEAD_MIN_ROWS rows or more (l2_prefetch_lead None), every graph (True) or none (False); 8B,
    whose plan has no whole range and so no tiles, has no side work at any batch size."""
    from fgchat.engine.model import fused_step
    from fgchat.protocol.tuning import Tuning

    monkeypatch.setattr(lp, "supported", lambda device: True)
    issued: list[list] = []
    monkeypatch.setattr(lp, "issue", lambda ranges: issued.append(list(ranges)))
    assert fused_step.LEAD_MIN_ROWS == 4

    def kinds(st, rows: int) -> list[str] | None:
        work = st.side_work(rows)
        if work is None:
            return None
        issued.clear()
        work(len(st.dec.w.layers) - 1)  # the last layer
        return [type(r).__name__ for r in issued[0]]

    auto = _stages(2048, 8192, 3072, 2)
    assert [kinds(auto, b) for b in (1, 2, 3, 4, 8)] == [["Range"]] * 3 + [["Range", "Rows"]] * 2
    assert issued[0][0] == lp.Range(auto.dec.w.layers[1].wo.data_ptr(), 2048)  # layer 1's own o
    on = _stages(2048, 8192, 3072, 1, Tuning(l2_prefetch_lead=True))
    off = _stages(2048, 8192, 3072, 1, Tuning(l2_prefetch_lead=False))
    assert kinds(on, 1) == ["Range", "Rows"] and kinds(off, 8) == ["Range"]
    big = _stages(4096, 14336, 6144, 1)
    assert big.prefetch is None and big.lead is None and kinds(big, 8) is None


def _stages(hidden: int, inter: int, q: int, layers: int, tuning=None, mb: int | None = None):
    """FusedStages over `layers` bf16 layers of these shapes (CPU tensors: real, distinct
    addresses), as a GPU with the bulk prefetch would plan them (caller patches lp.supported)."""
    from types import SimpleNamespace

    from fgchat.engine.model.fused_step import FusedStages
    from fgchat.protocol.tuning import Tuning

    def w(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16)
    ls = [SimpleNamespace(wqkv=w(q, hidden), bqkv=None, wo=w(hidden, hidden), w_gate_up=w(2 * inter, hidden),
                          w_down=w(hidden, inter), attn_norm=w(hidden), mlp_norm=w(hidden)) for _ in range(layers)]
    weights = SimpleNamespace(layers=ls, lm_head=torch.empty(64, hidden),  # float32: no int8 pick copy
                              final_norm=w(hidden), family=None)
    # what FusedStages reads of a Llama config
    cfg = SimpleNamespace(qk_norm=False, gemma_norms=False, activation="silu", layer_windows=())
    return FusedStages(SimpleNamespace(w=weights, cfg=cfg), tuning or Tuning(), 132, pdl=True, l2_prefetch_mb=mb)
