"""The fused decoder on quantized weights (kernels.qgemv under Triton's interpreter) against the plain
decoder on the float64-composed values of the same planes held in float32: prefill (rows past the
skinny kernel through a dequantized copy and F.linear) and the decode step's stages (quantized embedding,
qkv as a stack of two formats, split o / down, GLU, LM head with its argmax). The mega kernel
refuses quantized weights with its reason."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from qweights import compose, random_qweight  # noqa: E402
from small_decoders import small_config  # noqa: E402

from fgchat.engine.kv_cache import KVCache  # noqa: E402
from fgchat.engine.model.decoder import Decoder, DecoderWeights, LayerWeights, StepState  # noqa: E402
from fgchat.engine.kernels import qtiles  # noqa: E402
from fgchat.engine.quant.qweight import stack_rows  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU files cover CUDA")
F32 = torch.float32


def _weights(cfg):
    """(quantized, dense) decoder weights holding the same values."""
    h, inter = cfg.hidden_size, cfg.intermediate_size

    def q(fmt, n, k, seed):
        w = random_qweight(fmt, n, k, seed, dtype=F32)
        return w, compose(w).float()

    layers_q, layers_d = [], []
    for i in range(cfg.num_layers):
        (qk, qk_d), (v, v_d) = q("Q8_0", cfg.q_size + cfg.kv_size, h, 10 * i), q("Q4_1", cfg.kv_size, h, 10 * i + 1)
        (wo, wo_d), (gu, gu_d), (dn, dn_d) = (q("Q4_0", h, cfg.q_size, 10 * i + 2),
                                              q("Q4_1", 2 * inter, h, 10 * i + 3), q("Q8_0", h, inter, 10 * i + 4))
        norm = torch.ones(h)
        layers_q.append(LayerWeights(norm, stack_rows([qk, v]), None, wo, norm, gu, dn))
        layers_d.append(LayerWeights(norm, torch.cat([qk_d, v_d]), None, wo_d, norm, gu_d, dn_d))
    (emb, emb_d), (head, head_d) = q("Q8_0", cfg.vocab_size, h, 98), q("Q8_0", cfg.vocab_size, h, 99)
    emb.planes["d"] = (emb.planes["d"].float() * 40).half()  # embeddings of unit size, as trained models'
    emb_d = compose(emb).float()
    return (DecoderWeights(emb, layers_q, torch.ones(h), head),
            DecoderWeights(emb_d, layers_d, torch.ones(h), head_d))


def test_prefill_and_decode_stages_match_the_plain_decoder_on_the_same_values():
    cfg = small_config(4, 2, False)  # hidden 64, intermediate 96, vocabulary 300
    wq, wd = _weights(cfg)
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    got = {}
    for name, w, fused in (("q", wq, True), ("d", wd, False)):
        dec = Decoder(cfg, w, 64, fused=fused)
        cache = KVCache(cfg, 64, torch.device("cpu"), F32)
        all_l = dec.prefill(ids, 2, cache.k, cache.v, all_logits=True)  # 20 rows: the GEMM
        got[name] = (dec, cache, all_l)
    (dq, cq, lq), (dd, cd, ld) = got["q"], got["d"]
    torch.testing.assert_close(lq, ld, rtol=1e-4, atol=1e-4)
    assert torch.equal(lq.argmax(dim=-1), ld.argmax(dim=-1))  # the greedy tokens of every row
    torch.testing.assert_close(cq.k[0][2, :20], cd.k[0][2, :20], rtol=1e-4, atol=1e-4)
    # one decode step's stages over two rows (the attention output given)
    st_q, st_d = StepState(), StepState()
    tok = torch.tensor([5, 77])
    st_q.h, st_q.delta = qtiles.dequantize_rows(wq.embed, tok), None
    dd.embed(st_d, tok)
    torch.testing.assert_close(st_q.h, st_d.h, rtol=0, atol=0)
    attn = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(3))
    for st, dec in ((st_q, dq), (st_d, dd)):
        dec.after_attention(0, st, attn)
        with dec.exact_head():  # the plain decoder's greedy pick keeps exact logits only where rescored
            dec.head(st, greedy=True)
    torch.testing.assert_close(st_q.logits, st_d.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(st_q.tokens, st_q.logits.argmax(dim=1))
    assert st_q.tokens.tolist() == st_d.logits.argmax(dim=1).tolist()


def test_mega_kernel_refuses_quantized_weights_with_a_reason():
    from fgchat.engine.kernels.megakernel import DecodeLayers

    cfg = small_config(4, 2, False)
    wq, _ = _weights(cfg)
    dec = Decoder(cfg, wq, 64, fused=True)
    with pytest.raises(ValueError, match="quantized"):
        DecodeLayers(dec, KVCache(cfg, 64, torch.device("cpu"), F32))


def test_a_roles_tile_reaches_the_quantized_launches(monkeypatch):
    """FGCHAT_PROJ_CONFIGS tiles quantized projections too (the pipeline depth of a launch is a
    tuning knob there as for bf16): each role's tile reaches qgemv's launches, the step's values
    are the picked tiles' (same K tile: same sums), and a tile that does not cut K is one error."""
    from fgchat.engine.kernels import qgemv
    from fgchat.protocol.errors import FgchatError
    from fgchat.protocol.tuning import Tuning

    cfg = small_config(4, 2, False)
    wq, _ = _weights(cfg)
    tiles = "qkv=8,64,1,3;o=8,32,1,4,0,2;gate_up=16,64,1,4;head=8,64,1,3"
    launched = []
    real = qgemv._launch
    monkeypatch.setattr(qgemv, "_launch", lambda *a, **kw: launched.append(kw.get("config")) or real(*a, **kw))
    tok = torch.tensor([5, 77])
    attn = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(3))
    out = {}
    for name, tuning in (("picked", Tuning()), ("tiled", Tuning(proj_configs=tiles))):
        dec = Decoder(cfg, wq, 64, fused=True, tuning=tuning)
        st = StepState()
        st.h, st.delta = qtiles.dequantize_rows(wq.embed, tok), None
        launched.clear()
        dec.after_attention(0, st, attn)
        dec.head(st, greedy=True)
        out[name] = (st.logits, st.tokens, list(launched))
    given = {qgemv.QConfig(8, 32, 1, 4), qgemv.QConfig(16, 64, 1, 4), qgemv.QConfig(8, 64, 1, 3)}  # o, gate_up, head
    assert given <= set(out["tiled"][2]) and not given & set(out["picked"][2])
    assert dec.fused_stages.o.split == 2
    assert torch.equal(out["picked"][1], out["tiled"][1])
    for bad, match in (("o=8,48,1,2", "o: .*do not cut K=64"), ("gate_up=8,64,1,2,0,2", "gate_up cannot be split")):
        with pytest.raises(FgchatError, match=match):
            Decoder(cfg, wq, 64, fused=True, tuning=Tuning(proj_configs=bad))
