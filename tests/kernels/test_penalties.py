"""fgchat.engine.kernels.penalties against transformers' RepetitionPenaltyLogitsProcessor and
OpenAI's presence / frequency formula computed by hand.

On CPU the torch implementation runs here, and the Triton kernels run the same tests under
Triton's interpreter in a subprocess (FGCHAT_TEST_PENALTIES_TRITON=1, TRITON_INTERPRET=1: the
variable must be set before triton loads). On a GPU: the kernels inside a captured CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch
from interpreter_rerun import rerun_under_interpreter

from fgchat.engine.kernels import penalties
from fgchat.engine.kernels.penalties import alloc_state, reset_slot

TRITON = os.environ.get("FGCHAT_TEST_PENALTIES_TRITON") == "1"


def apply_penalties(*args) -> None:
    penalties.apply_penalties(*args, use_triton=True if TRITON else None)


def record_tokens(*args) -> None:
    penalties.record_tokens(*args, use_triton=True if TRITON else None)

NUM_SLOTS = 8
V = 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _state(lanes: list[tuple[int, list[int], list[int]]], device="cpu"):
    """counts / prompt_mask after admitting each (slot, prompt, output) lane and recording its
    output one step at a time, all lanes together, as the decode loop does."""
    counts, mask = alloc_state(NUM_SLOTS, V, device)
    # dirty every slot first: reset_slot must forget what an earlier request left
    counts += 3
    mask.fill_(True)
    for slot, prompt, _ in lanes:
        reset_slot(counts, mask, slot, prompt)
    slots = torch.tensor([s for s, _, _ in lanes], device=device)
    for step in range(max(len(out) for _, _, out in lanes)):
        # lanes whose output is shorter sit this step out (smaller batch), as in the engine
        live = [i for i, (_, _, out) in enumerate(lanes) if step < len(out)]
        toks = torch.tensor([lanes[i][2][step] for i in live], device=device)
        record_tokens(counts, slots[live], toks)
    return counts, mask, slots


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, V, generator=g) * 4  # plenty of negative and positive logits
    x[:, 0] = -0.0
    x[:, 1] = float("-inf")
    return x


LANES = [  # (slot, prompt ids, output ids): repeated ids, ids in both, negative logits, id 0/1 edges
    (5, [3, 7, 7, 9, 1, 0], [7, 11, 11, 11, 2]),
    (0, [4, 5, 6], [6, 6, 12, 40, 63]),
    (3, [20], [20, 21, 22]),
]


def test_reset_and_record_counts():
    counts, mask, _ = _state(LANES)
    for slot, prompt, out in LANES:
        want = torch.zeros(V, dtype=torch.int32)
        for t in out:
            want[t] += 1
        assert torch.equal(counts[slot], want)
        assert mask[slot].nonzero().flatten().tolist() == sorted(set(prompt))
    untouched = [s for s in range(NUM_SLOTS) if s not in {s for s, _, _ in LANES}]
    assert (counts[untouched] == 3).all() and mask[untouched].all()


def test_repetition_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    reps = [1.3, 0.7, 2.0]  # < 1 rewards repetition: both branches of the rule
    counts, mask, slots = _state(LANES)
    logits = _logits(len(LANES))
    got = logits.clone()
    zero = torch.zeros(len(LANES))
    apply_penalties(got, counts, mask, slots, torch.tensor(reps), zero, zero)
    for i, ((_, prompt, out), rep) in enumerate(zip(LANES, reps)):
        ids = torch.tensor([prompt + out])
        want = RepetitionPenaltyLogitsProcessor(rep)(ids, logits[i : i + 1].clone())[0]
        assert torch.equal(_bits(got[i]), _bits(want)), i
    assert not torch.equal(got, logits)


def _openai(row: list[float], out: list[int], pres: float, freq: float) -> list[float]:
    """OpenAI's documented formula, in float64: mu[j] - c[j] * freq - [c[j] > 0] * pres."""
    c = [out.count(j) for j in range(V)]
    return [x - c[j] * freq - (1.0 if c[j] > 0 else 0.0) * pres for j, x in enumerate(row)]


def test_presence_frequency_match_openai_formula():
    pres, freq = [0.5, -0.3, 2.0], [0.25, 1.5, -2.0]
    counts, mask, slots = _state(LANES)
    logits = _logits(len(LANES), seed=1)
    got = logits.clone()
    apply_penalties(got, counts, mask, slots, torch.ones(3), torch.tensor(pres), torch.tensor(freq))
    for i, (_, prompt, out) in enumerate(LANES):
        want = torch.tensor(_openai(logits[i].double().tolist(), out, pres[i], freq[i]), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), want, rtol=0, atol=1e-5)
        # prompt-only ids are untouched by presence / frequency
        only_prompt = sorted(set(prompt) - set(out) - {1})
        assert torch.equal(got[i, only_prompt], logits[i, only_prompt])


def test_all_three_together_and_mixed_lanes():
    """Lane 0 everything, lane 1 nothing (bit-identical), lane 2 repetition only; repetition first,
    then OpenAI's rules on the result."""
    from transformers import RepetitionPenaltyLogitsProcessor

    rep, pres, freq = [1.2, 1.0, 1.5], [0.4, 0.0, 0.0], [0.3, 0.0, 0.0]
    counts, mask, slots = _state(LANES)
    logits = _logits(3, seed=2)
    got = logits.clone()
    apply_penalties(got, counts, mask, slots, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq))
    for i, (_, prompt, out) in enumerate(LANES):
        ids = torch.tensor([prompt + out])
        after_rep = RepetitionPenaltyLogitsProcessor(rep[i])(ids, logits[i : i + 1].clone())[0]
        want = torch.tensor(_openai(after_rep.double().tolist(), out, pres[i], freq[i]), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), want, rtol=0, atol=1e-5)
    assert torch.equal(_bits(got[1]), _bits(logits[1]))


def test_neutral_lane_is_bit_identical():
    """1 / 0 / 0 on a slot that has seen many ids, with -0.0, -inf, huge and tiny logits."""
    counts, mask, slots = _state(LANES)
    logits = _logits(3, seed=3)
    logits[:, 2] = 3.0e38
    logits[:, 3] = -1.0e-40  # subnormal
    logits[:, 7] = 1.0e-45
    got = logits.clone()
    ones, zeros = torch.ones(3), torch.zeros(3)
    apply_penalties(got, counts, mask, slots, ones, zeros, zeros)
    assert torch.equal(_bits(got), _bits(logits))


def test_batch_order_and_subsets_do_not_matter():
    """A lane's result depends on its slot and penalties only, not on its position in the batch."""
    counts, mask, slots = _state(LANES)
    logits = _logits(3, seed=4)
    rep, pres, freq = torch.tensor([1.1, 1.7, 0.9]), torch.tensor([0.2, 0.0, 1.0]), torch.tensor([0.1, 0.5, 0.0])
    full = logits.clone()
    apply_penalties(full, counts, mask, slots, rep, pres, freq)
    perm = torch.tensor([2, 0, 1])
    shuffled = logits[perm].clone()
    apply_penalties(shuffled, counts, mask, slots[perm], rep[perm], pres[perm], freq[perm])
    assert torch.equal(_bits(shuffled), _bits(full[perm]))
    one = logits[1:2].clone()
    apply_penalties(one, counts, mask, slots[1:2], rep[1:2], pres[1:2], freq[1:2])
    assert torch.equal(_bits(one[0]), _bits(full[1]))


def test_penalties_change_greedy_choice():
    """The point of it all: a repeated favourite loses to a fresh id."""
    counts, mask = alloc_state(NUM_SLOTS, V, "cpu")
    reset_slot(counts, mask, 2, [10])
    logits = torch.full((1, V), -5.0)
    logits[0, 10], logits[0, 11] = 2.0, 1.5
    slots = torch.tensor([2])
    apply_penalties(logits, counts, mask, slots, torch.tensor([1.5]), torch.zeros(1), torch.zeros(1))
    assert int(logits.argmax()) == 11


@pytest.mark.skipif(TRITON, reason="this is the parent run")
def test_triton_kernels_under_interpreter():
    """Every CPU test above again, through the Triton kernels in Triton's interpreter."""
    rerun_under_interpreter(__file__, "FGCHAT_TEST_PENALTIES_TRITON", "not interpreter and not cuda", 8)


def test_bad_shapes_are_errors():
    counts, mask = alloc_state(NUM_SLOTS, V, "cpu")
    one = torch.ones(1)
    with pytest.raises(ValueError, match="does not fit"):
        apply_penalties(torch.zeros(1, V + 1), counts, mask, torch.zeros(1, dtype=torch.long), one, one, one)
    with pytest.raises(ValueError, match="float32"):
        apply_penalties(torch.zeros(1, V, dtype=torch.float64), counts, mask, torch.zeros(1, dtype=torch.long),
                        one, one, one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_match_torch():
    """Triton vs the torch composition on the GPU: repetition bit-identical, presence / frequency
    within an ulp or so (FMA)."""
    dev = torch.device("cuda")
    vocab = 151_936
    g = torch.Generator(device=dev).manual_seed(1)
    counts, mask = alloc_state(NUM_SLOTS, vocab, dev)
    for s in range(NUM_SLOTS):
        reset_slot(counts, mask, s, torch.randint(0, vocab, (300,), device=dev, generator=g))
        toks = torch.randint(0, vocab, (200,), device=dev, generator=g)
        for t in toks.view(-1, 1):
            penalties.record_tokens(counts, torch.tensor([s], device=dev), t, use_triton=True)
    ref = counts.clone()
    ref.zero_()
    slots = torch.tensor([7, 2, 0, 5, 1, 3, 6, 4], device=dev)
    rep = torch.tensor([1.3, 1.0, 0.8, 1.0, 1.05, 2.0, 1.0, 1.1], device=dev)
    pres = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, -1.0, 0.0, 0.3], device=dev)
    freq = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0, 0.7, 0.0, -0.4], device=dev)
    x = torch.randn(8, vocab, device=dev, generator=g) * 5
    a, b = x.clone(), x.clone()
    penalties.apply_penalties(a, counts, mask, slots, rep, pres, freq, use_triton=True)
    penalties.apply_penalties(b, counts, mask, slots, rep, pres, freq, use_triton=False)
    plain = (pres == 0) & (freq == 0)
    assert torch.equal(_bits(a[plain]), _bits(b[plain]))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    assert torch.equal(_bits(a[1]), _bits(x[1])) and torch.equal(_bits(a[6]), _bits(x[6]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_eager_and_does_not_sync():
    dev = torch.device("cuda")
    vocab = 151_936
    counts, mask = alloc_state(NUM_SLOTS, vocab, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for s in range(NUM_SLOTS):
        reset_slot(counts, mask, s, torch.randint(0, vocab, (50,), device=dev, generator=g))
    b = 4
    logits = torch.empty(b, vocab, device=dev)
    slots = torch.tensor([6, 1, 3, 0], device=dev)
    rep = torch.tensor([1.1, 1.0, 1.3, 1.05], device=dev)
    pres = torch.tensor([0.5, 0.0, 0.0, 0.2], device=dev)
    freq = torch.tensor([0.1, 0.0, 0.4, 0.0], device=dev)
    tokens = torch.empty(b, dtype=torch.long, device=dev)
    ref_counts = counts.clone()

    def step():
        apply_penalties(logits, counts, mask, slots, rep, pres, freq)
        tokens.copy_(logits.argmax(dim=-1))
        record_tokens(counts, slots, tokens)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        logits.normal_(generator=g)
        step()  # warm up the allocator off the default stream
    torch.cuda.current_stream().wait_stream(s)
    counts.copy_(ref_counts)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_counts, eager_mask = ref_counts.clone(), mask.clone()
    for it in range(5):
        x = torch.randn(b, vocab, device=dev, generator=g) * 3
        logits.copy_(x)
        graph.replay()
        want = x.clone()
        apply_penalties(want, eager_counts, eager_mask, slots, rep, pres, freq)
        want_tok = want.argmax(dim=-1)
        record_tokens(eager_counts, slots, want_tok)
        assert torch.equal(logits, want), it
        assert torch.equal(tokens, want_tok), it
        assert torch.equal(counts, eager_counts), it
