"""CUDA-graph modes on a GPU: identical output across eager / piecewise / full.

Run on the H200 (skipped without CUDA): pytest -m gpu tests/gpu/test_gpu_graphs.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.protocol.tuning import Tuning
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import Mode, RequestFinished, SamplingParams, TokenEvent

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = ("eager", "piecewise", "full")


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    import tiny_models

    return tiny_models.build_model(tmp_path_factory.mktemp("gpu") / "m", "llama", hidden=512,
                                   layers=3, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                                   max_pos=8192, seed=7)


@pytest.fixture(scope="module")
def engine(gqa_model):
    return Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16",
                               max_context=4096, mode="full"))


def prompt_of(n, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(engine, mode, prompts, params, toggle_every=None, record_logits=False):
    engine.set_mode(mode)
    engine.keep_logits, engine.step_logits = record_logits, []
    rids = [engine.submit(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    events, step = [], 0
    while engine.has_work():
        if toggle_every and step % toggle_every == 0:
            engine.set_mode(MODES[(step // toggle_every) % 3])
        events += engine.step()
        step += 1
    logits = [t.float() for t in engine.step_logits]
    done = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}
    return [done[r].token_ids for r in rids], events, logits


def test_all_modes_available_after_self_check(engine):
    info = engine.info()
    assert info.available_modes == {"eager": "", "piecewise": "", "full": "", "mega": ""}, info.notes
    sizes = {(c.mode, c.batch_size) for c in info.captures}
    assert sizes >= {(m, b) for m in ("piecewise", "full") for b in range(1, 9)}
    assert not {b for m, b in sizes if m == "mega"}  # mega: captured on first use or while idle


@pytest.mark.parametrize("batch", range(1, 9))
def test_greedy_identical_across_modes(engine, batch):
    v = engine.cfg.vocab_size
    prompts = [prompt_of(5 + 37 * i, 100 * batch + i, v) for i in range(batch)]
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    ref, _, ref_logits = run(engine, "eager", prompts, sp, record_logits=True)
    for mode in ("piecewise", "full"):
        got, events, logits = run(engine, mode, prompts, sp, record_logits=True)
        assert got == ref, mode
        for a, b in zip(logits, ref_logits):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        decode_modes = {e.mode for e in events if isinstance(e, TokenEvent) and not e.is_first_token}
        assert decode_modes == {mode}


def test_long_context_past_capture(engine):
    v = engine.cfg.vocab_size
    prompts = [prompt_of(3000 + 17 * i, 7 + i, v) for i in range(3)]
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    ref, _, _ = run(engine, "eager", prompts, sp)
    for mode in ("piecewise", "full"):
        assert run(engine, mode, prompts, sp)[0] == ref, mode


def test_join_and_leave_use_graph_of_each_size(engine):
    v = engine.cfg.vocab_size
    prompts = [prompt_of(10 + 3 * i, 50 + i, v) for i in range(8)]
    params = [SamplingParams(max_tokens=20 + 6 * i, ignore_eos=True) for i in range(8)]

    def staged(mode):
        engine.set_mode(mode)
        engine.step_graphs.clear()
        rids, events, sizes = [], [], []
        for i in range(8):  # one request joins every other step
            rids.append(engine.submit(prompts[i], params[i]))
            for _ in range(2):
                events += engine.step()
                sizes.append(engine.running_batch_size())
        events += engine.run_until_done()
        done = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}
        steps = [e for e in events if isinstance(e, TokenEvent) and not e.is_first_token]
        return [done[r].token_ids for r in rids], steps, list(engine.step_graphs)

    ref, _, _ = staged("eager")
    got, steps, graphs = staged("full")
    assert got == ref
    assert {e.batch_size for e in steps} == set(range(1, 9))
    for e in steps:
        assert e.graph == f"full/b{e.batch_size}"
    assert all(g is not None and g.startswith("full/b") for g in graphs)


def test_toggle_every_few_tokens_batch8(engine):
    v = engine.cfg.vocab_size
    prompts = [prompt_of(20 + 9 * i, 300 + i, v) for i in range(8)]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    ref, _, _ = run(engine, "eager", prompts, sp)
    got, events, _ = run(engine, "full", prompts, sp, toggle_every=3)
    assert got == ref
    assert {e.mode for e in events if isinstance(e, TokenEvent) and not e.is_first_token} == set(MODES)


def test_seeded_sampling_identical_across_modes(engine):
    v = engine.cfg.vocab_size
    prompts = [prompt_of(30 + i, 900 + i, v) for i in range(4)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11 + i, max_tokens=40,
                             ignore_eos=True) for i in range(4)]
    outs = [run(engine, m, prompts, params)[0] for m in MODES]
    assert outs[0] == outs[1] == outs[2]


def test_self_check_disables_a_broken_mode(gqa_model):
    eng = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16",
                              max_context=1024, mode="full", self_check=False))
    # swap the batch-3 graph for the batch-2 one: a graph replayed at the wrong size
    full = eng.modes.modes[Mode.FULL]
    full.graphs[(3, False)] = full.graphs[(2, False)]
    eng.modes.self_check(Mode.FULL)
    assert "self-check" in eng.info().available_modes["full"]
    assert eng.set_mode("full").mode == "eager"


def test_bf16_parity_with_transformers(gqa_model):
    """bf16: each decode step's logits match transformers on the same prefix (teacher forcing),
    and the greedy token agrees wherever transformers' top-2 margin exceeds bf16 noise."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.bfloat16).cuda().eval()
    eng = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16", max_context=1024,
                              mode="full"))
    prompt = prompt_of(40, 5, eng.cfg.vocab_size)
    eng.keep_logits = True
    rid = eng.submit(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    events = []
    while eng.has_work():
        events += eng.step()
    step_logits = [t[0].float() for t in eng.step_logits]
    ours = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}[rid].token_ids
    with torch.no_grad():
        hf = ref(torch.tensor([prompt + ours], device="cuda")).logits[0].float()
    checked = 0
    for i, logits in enumerate(step_logits):  # step i produced output token i + 1
        want = hf[len(prompt) + i]
        # Both sides compute in bf16 and round the logits to bf16 (one step = 2^-7 relative), with
        # sums in different orders (cuBLAS vs our kernels): single logits may differ by a few
        # steps, the mean difference stays within 4 steps of the mean magnitude.
        torch.testing.assert_close(logits, want, rtol=5e-2, atol=2.5e-1)
        assert (logits - want).abs().mean() <= 4 * 2**-7 * want.abs().mean()
        top2 = want.topk(2).values
        if (top2[0] - top2[1]).item() > 0.25:
            assert ours[i + 1] == int(want.argmax())
            checked += 1
    assert checked >= len(step_logits) // 2


def test_random_llama_1b_generates():
    eng = Engine(EngineConfig(preset="llama-3.2-1b", device="cuda", dtype="bfloat16",
                              max_context=2048, mode="full"))
    rids = [eng.submit(prompt_of(512, i, eng.cfg.vocab_size), SamplingParams(max_tokens=32, ignore_eos=True))
            for i in range(8)]
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    assert all(done[r].output_tokens == 32 for r in rids)


def test_batch_of_eight_matches_alone_bf16(engine):
    """bf16 on the GPU: 8 prompts of different lengths decoded together give each one's solo
    tokens. Each is admitted in a step of its own, so it is prefilled alone (a one-pass prefill of
    a round runs other GEMM shapes, so other rounding: tests/gpu/test_gpu_prefill.py checks it
    against float32); the decode steps then run batches of 1 to 8."""
    v = engine.cfg.vocab_size
    prompts = [prompt_of(3 + 29 * i, 700 + i, v) for i in range(8)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    alone = [run(engine, "full", [p], sp)[0][0] for p in prompts]
    engine.set_mode("full")
    rids, events = [], []
    for p in prompts:
        rids.append(engine.submit(p, sp))
        events += engine.step()
    while engine.has_work():
        events += engine.step()
    done = {e.summary.request_id: e.summary.token_ids for e in events if isinstance(e, RequestFinished)}
    assert [done[r] for r in rids] == alone


def test_pipelined_equals_plain_loop_with_joins_and_leaves(engine, gqa_model):
    """The default (pipelined) engine and a plain-loop engine produce the same tokens while
    requests of different lengths and sampling settings join and leave, in every mode."""
    assert engine.pipelined
    plain = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16",
                                max_context=4096, mode="full"))
    plain.pipelined = False
    v = engine.cfg.vocab_size
    prompts = [prompt_of(9 + 41 * i, 900 + i, v) for i in range(6)]
    params = [SamplingParams(max_tokens=8 + 11 * i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(6)]
    for mode in MODES:
        want, _, _ = run(plain, mode, prompts, params)
        got, events, _ = run(engine, mode, prompts, params)
        assert got == want, mode
        assert {e.mode for e in events if isinstance(e, TokenEvent) and not e.is_first_token} == {mode}


def test_current_row_from_registers_modes_identical(gqa_model):
    """The current K/V row from registers inside the attention (the default): every mode of the
    engine still gives the eager mode's greedy tokens, at batch 1 and 8."""
    eng = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16",
                              max_context=4096, mode="full"))
    assert eng.decoder.rope_in_attention and not eng.attention.cur_from_cache
    v = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    for batch in (1, 8):
        prompts = [prompt_of(9 + 41 * i, 500 + batch + i, v) for i in range(batch)]
        want, _, _ = run(eng, "eager", prompts, sp)
        for mode in ("piecewise", "full"):
            got, _, _ = run(eng, mode, prompts, sp)
            assert got == want, (mode, batch)


def stages_and_launch_lists(model, mode: str) -> tuple[Engine, Engine]:
    """Two engines on `model`: one whose eager steps run through the stages every time, one as
    built (eager replays launch lists)."""
    off = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=4096, mode=mode))
    off.modes.eager.launch_lists_on = False
    on = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=4096, mode=mode))
    return off, on


def test_piecewise_recorded_attention_same_tokens(gqa_model):
    """Piecewise replay runs each attention call as a launch list recorded once per batch size
    and layer; it gives the tokens of eager through the stages."""
    plain, eng = stages_and_launch_lists(gqa_model, "piecewise")
    v = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    for batch in (1, 5):
        prompts = [prompt_of(11 + 37 * i, 900 + batch + i, v) for i in range(batch)]
        want, _, _ = run(plain, "eager", prompts, sp)
        assert run(eng, "piecewise", prompts, sp)[0] == want, batch
    graph = eng.modes.modes[Mode.PIECEWISE].graphs[(5, False)]
    # every attention call replays a recorded list: bound Triton launches with a fast path (which
    # the piecewise replay checks once per step, launch.batched) or recorded torch ops (partials)
    from functools import partial

    assert all(isinstance(c, partial) or hasattr(c, "fast") for a in graph.attends for c in a), graph.attends
    assert any(hasattr(c, "fast") for a in graph.attends for c in a)
    assert graph._run is not None


@pytest.mark.parametrize("variant", ["greedy", "sampled", "filtered", "penalized"])
def test_eager_launch_list_same_tokens(gqa_model, variant):
    """Eager replaying the launch list recorded from its first step at each batch size and step
    variant gives the tokens of eager through the stages, bit for bit in the logits, and of the
    full graphs. Greedy and sampled steps (with and without top-k / top-p) record whole."""
    from fgchat.engine.step import Variant

    plain, eng = stages_and_launch_lists(gqa_model, "eager")
    v = eng.cfg.vocab_size
    extra = {"greedy": {}, "sampled": dict(temperature=0.8), "filtered": dict(temperature=0.8, top_p=0.9, top_k=40),
             "penalized": dict(repetition_penalty=1.5, presence_penalty=0.3)}[variant]
    key = {"greedy": Variant.GREEDY, "sampled": Variant.SAMPLED, "filtered": Variant.SAMPLED_FILTERED,
           "penalized": Variant.PENALIZED}[variant]
    for batch in (1, 3, 8):
        prompts = [prompt_of(13 + 31 * i, 700 + batch + i, v) for i in range(batch)]
        sp = [SamplingParams(max_tokens=40, ignore_eos=True, seed=5 + i, **extra) for i in range(batch)]
        want, _, want_logits = run(plain, "eager", prompts, sp, record_logits=True)
        got, _, got_logits = run(eng, "eager", prompts, sp, record_logits=True)
        assert got == want, batch
        # the replayed launches are the stages' own (cuBLAS projections as mm into their result)
        assert len(got_logits) == len(want_logits)
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits)), batch
        assert run(eng, "full", prompts, sp)[0] == want, batch
        if variant != "penalized":
            assert eng.modes.eager.launch_lists.get((batch, key)) is not None, eng.notes
    assert not plain.modes.eager.launch_lists


def test_penalties_inside_graphs_equal_eager(engine):
    """Repetition / presence / frequency penalties run inside the full and piecewise graphs (the
    PENALIZED step variant, per-slot counts on the device): every mode gives eager's tokens for a
    batch mixing penalized greedy, penalized sampled and plain lanes, and the penalties change
    the text."""
    v = engine.cfg.vocab_size
    prompts = [prompt_of(20 + 13 * i, 4200 + i, v) for i in range(4)]
    pen = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **pen),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=3, **pen),
              SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=25, ignore_eos=True, repetition_penalty=1.3)]
    want, _, _ = run(engine, "eager", prompts, params)
    for mode in ("piecewise", "full"):
        assert run(engine, mode, prompts, params)[0] == want, mode
    plain, _, _ = run(engine, "full", prompts[:1], SamplingParams(max_tokens=40, ignore_eos=True))
    assert plain[0] != want[0], "the penalties changed nothing"


@torch.inference_mode()
def test_penalized_step_matches_a_float64_reference(engine):
    """One PENALIZED step (eager, piecewise and full) against the same step's plain logits
    penalized in float64 on the host, with random counts and prompt masks in the slots."""
    from fgchat.engine.step import Variant

    prog, b, v = engine.program, 5, engine.cfg.vocab_size
    g = torch.Generator().manual_seed(11)
    slots = [6, 1, 3, 0, 7]
    reps, pres, freqs = [1.0, 1.5, 0.8, 2.0, 1.2], [0.0, 0.5, -0.3, 1.0, 0.2], [0.0, 0.25, 0.1, -0.5, 0.4]

    def stage() -> None:
        prog.bufs.stage([5, 9, 11, 2, 30], [40, 7, 100, 3, 64], slots, [0.0] * b, [1.0] * b, [0] * b,
                        [0] * b, reps, pres, freqs)

    stage()
    plain = prog.run_eager(b, Variant.GREEDY).logits.double().cpu()
    counts = torch.randint(0, 3, (8, v), generator=g, dtype=torch.int32) * (torch.rand(8, v, generator=g) < 0.1)
    mask = torch.rand(8, v, generator=g) < 0.05
    idx = torch.tensor(slots)
    c, seen = counts[idx].double(), mask[idx] | (counts[idx] > 0)
    r = torch.tensor(reps, dtype=torch.float64)[:, None]
    want = torch.where(seen, torch.where(plain < 0, plain * r, plain / r), plain)
    want = want - torch.tensor(freqs, dtype=torch.float64)[:, None] * c
    want = want - torch.tensor(pres, dtype=torch.float64)[:, None] * (c > 0)
    outs = {}
    for mode in ("eager", "piecewise", "full"):
        prog.counts.copy_(counts)
        prog.prompt_mask.copy_(mask)
        stage()
        out, _ = engine.modes.run(Mode(mode), b, Variant.PENALIZED)
        torch.cuda.synchronize()
        outs[mode] = (out.logits.double().cpu(), out.tokens.cpu())
        torch.testing.assert_close(outs[mode][0], want, rtol=1e-6, atol=1e-5)
        assert outs[mode][1].tolist() == want.argmax(-1).tolist(), mode
        after = prog.counts.cpu()  # each lane's token counted once more in its slot
        for lane, slot in enumerate(slots):
            tok = int(outs[mode][1][lane])
            assert after[slot, tok] == counts[slot, tok] + 1, (mode, lane)
    assert all(torch.equal(outs["eager"][0], outs[m][0]) for m in ("piecewise", "full"))


def test_idle_capture_defers_all_but_batch_one_and_matches(gqa_model):
    """Tuning(idle_capture=True): the engine starts with full mode's batch-1 graph only and has not run
    its start-up check; the first idle turn runs the check, the idle captures (Engine.capture_idle,
    one per call) then bring every size of both modes and every prefill
    bucket, self-checked, and the tokens equal those of an engine that captured at start."""
    eng = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16", max_context=4096, mode="full",
                              tuning=Tuning(idle_capture=True)))
    ref = Engine(EngineConfig(model=str(gqa_model), device="cuda", dtype="bfloat16", max_context=4096, mode="full"))
    full = eng.modes.modes[Mode.FULL]
    assert set(full.graphs) == {(1, False)}, sorted(full.graphs)
    assert not eng.modes.modes[Mode.PIECEWISE].graphs
    assert eng.startup_check is None and eng.startup_check_pending  # deferred too, run first
    assert eng.capture_idle() and eng.startup_check is not None and eng.startup_check.passed
    assert set(full.graphs) == {(1, False)} and eng.decoder.fused
    pre = len(eng.modes.prefill_graphs.graphs)
    n = 0
    while eng.capture_idle():
        n += 1
    # the prefill buckets the start-up check did not capture, 7 full, 8 piecewise and 8 mega sizes,
    # full's batch 1 again (captured before the buckets: ModeSet.decode_stale), then once the
    # settling after them (the eager recorder primed, the heap frozen again)
    assert n == len(eng.modes.prefill_graphs.buckets) - pre + 23 + 1 + 1, n
    assert eng._settled
    assert {b for b, _ in full.graphs} == set(range(1, 9))
    assert {b for b, _ in eng.modes.modes[Mode.PIECEWISE].graphs} == set(range(1, 9))
    assert set(eng.modes.prefill_graphs.graphs) == set(eng.modes.prefill_graphs.buckets)
    assert not any(eng.modes.unavailable.values()), eng.modes.unavailable
    v = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    for batch in (1, 3, 8):
        prompts = [prompt_of(17 + 29 * i, 800 + batch + i, v) for i in range(batch)]
        for mode in ("full", "piecewise"):
            assert run(eng, mode, prompts, sp)[0] == run(ref, mode, prompts, sp)[0], (mode, batch)
