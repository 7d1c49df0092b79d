"""The next turn of a chat on the GPU's fused path, prefilled after the rows its slot still holds
(engine.prefix_reuse): tokens against transformers in float32, bf16 logits against the float32
reference, and the histories forgotten where captures and self-checks write slots.

Run on the GPU: pytest -m gpu tests/gpu/test_gpu_prefix_reuse.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model.prefill import PREFILL_BUCKETS, prefill_after
from fgchat.protocol.events import RequestFinished, SamplingParams
from fgchat.protocol.tuning import Tuning
from test_prefix_reuse import hf_greedy, random_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CTX = 2560
REUSE = Tuning(prefix_reuse=True)  # on CUDA only where forced (prefix_reuse=True)


def run(eng: Engine, prompt: list[int], n: int, ignore_eos: bool = True) -> object:
    rid = eng.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=ignore_eos))
    while True:
        for ev in eng.step():
            if isinstance(ev, RequestFinished) and ev.summary.request_id == rid:
                return ev.summary


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Head dim 64 (the Triton attention's), context past the last prefill bucket."""
    import tiny_models

    return tiny_models.head64_model(tmp_path_factory.mktemp("reuse") / "m")


@pytest.fixture(scope="module")
def hf(model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", max_context=CTX, mode="eager",
                              tuning=REUSE))
    assert eng.decoder.fused
    return eng


def next_turn(eng: Engine, hf, prompt_len: int, seed: int, n: int = 6) -> tuple[int, int]:
    """A turn, then the next one (its conversation and a new message): (rows the second turn
    reused, the rows it could have), its tokens checked against transformers' greedy ones."""
    vocab = eng.cfg.vocab_size
    base = random_ids(prompt_len, seed, vocab)
    first = run(eng, base, n)
    nxt = base + first.token_ids + random_ids(12, seed + 1, vocab)
    second = run(eng, nxt, n)
    assert second.token_ids == hf_greedy(hf, nxt, n)
    return second.cached_tokens, prompt_len + n - 1


def test_the_next_turn_in_eager_mode_prefills_only_what_follows_and_gives_transformers_tokens(engine, hf):
    engine.set_mode("eager")
    cached, possible = next_turn(engine, hf, 300, 1, n=10)
    assert cached == possible


def test_full_mode_prefills_afresh_where_a_graph_covers_the_prompt_and_reuses_past_the_last_bucket(engine, hf):
    engine.set_mode("full")
    cached, _ = next_turn(engine, hf, 200, 3)
    assert cached == 0, "a prefill graph runs the whole prompt faster than the eager suffix"
    cached, possible = next_turn(engine, hf, PREFILL_BUCKETS[-1] + 40, 5)
    assert cached == possible


def test_idle_captures_and_self_checks_forget_every_history(model):
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", max_context=512,
                              mode="eager", tuning=Tuning(idle_capture=True, prefix_reuse=True)))
    vocab = eng.cfg.vocab_size
    base = random_ids(100, 7, vocab)
    first = run(eng, base, 8)
    assert any(eng.history.ids), "the finished turn left its slot's history"
    assert eng.capture_idle(), "start-up left captures for idle time"
    assert not any(eng.history.ids), "a capture while idle writes slots: no history survives it"
    again = run(eng, base + first.token_ids + [5, 6, 7], 4)
    assert again.cached_tokens == 0
    third = run(eng, base + first.token_ids + [5, 6, 7] + again.token_ids + [8], 4)
    assert third.cached_tokens > 0
    eng.capture_sizes("full", [1])
    assert not any(eng.history.ids), "the self-check's steps write slots"


def engines(model: str, ctx: int) -> tuple[Engine, Engine]:
    """A bf16 engine and a float32 one whose weights the reference runs on."""
    eng = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_context=ctx, mode="eager",
                              tuning=REUSE))
    w32 = Engine(EngineConfig(model=model, device="cuda", dtype="float32", max_context=ctx, mode="eager",
                              lazy_capture=True))
    return eng, w32


def logits_against_float32(eng: Engine, w32: Engine, nxt: list[int]) -> tuple[torch.Tensor, ...]:
    """The next turn's last logits prefilled after the reusable rows of eng's best slot, a fresh
    bf16 prefill of the whole prompt, the float32 reference, and the rows reused."""
    from fgchat.engine.model.reference import reference_logits

    slot = max(range(8), key=lambda s: eng.history.reusable(s, nxt))
    m = eng.history.reusable(slot, nxt)
    ids = torch.tensor(nxt, device="cuda")
    with torch.inference_mode():
        reused = prefill_after(eng.decoder, ids[m:], m, slot, eng.cache.k, eng.cache.v).float()
        fresh = eng.decoder.prefill(ids, (slot + 1) % 8, eng.cache.k, eng.cache.v).float()
        d = w32.decoder
        ref = reference_logits(d.cfg, d.w, ids, d.cos, d.sin, d.scale)[-1]
    return reused, fresh, ref, m


def test_in_bf16_the_next_turn_stays_as_close_to_float32_as_a_fresh_prefill(model):
    eng, w32 = engines(str(model), 512)
    vocab = eng.cfg.vocab_size
    fresh_err, reuse_err = [], []
    for seed in range(4):
        base = random_ids(120, 10 + seed, vocab)
        turn = run(eng, base, 24)
        reused, fresh, ref, m = logits_against_float32(eng, w32, base + turn.token_ids + random_ids(6, 20 + seed, vocab))
        assert m == len(base) + 23
        fresh_err.append((fresh - ref).abs().max().item())
        reuse_err.append((reused - ref).abs().max().item())
        eng.history.clear()
    assert max(reuse_err) <= 2 * max(fresh_err) + 1e-3, (reuse_err, fresh_err)


def test_real_weights_next_turn_in_bf16_stays_as_close_to_float32_as_a_fresh_prefill():
    """The embedded model's real weights (FGCHAT_REAL_GGUF): a chat's second turn prefilled after
    the first turn's rows, against the float32 reference of the whole prompt."""
    import os

    path = os.environ.get("FGCHAT_REAL_GGUF")
    if not path or not os.path.isfile(path):
        pytest.skip("FGCHAT_REAL_GGUF not set")
    eng, w32 = engines(path, 1024)
    tok = eng.tokenizer
    chat = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    base = tok.apply_chat_template(chat, add_generation_prompt=True)
    turn = run(eng, base, 80, ignore_eos=False)
    chat += [{"role": "assistant", "content": tok.decode(turn.token_ids)},
             {"role": "user", "content": "Which of them is the longest?"}]
    reused, fresh, ref, m = logits_against_float32(eng, w32, tok.apply_chat_template(chat, add_generation_prompt=True))
    assert m >= len(base), "the next turn starts with the whole first turn"
    fresh_err = (fresh - ref).abs().mean().item()
    reuse_err = (reused - ref).abs().mean().item()
    assert int(reused.argmax()) == int(ref.argmax())
    assert reuse_err <= 2 * fresh_err + 1e-3, (reuse_err, fresh_err)
