"""The compiled CPU decode step (engine.cpu_compiled): against the float32 reference, built in a
child process and loaded by the engine, cached by weights, and off with a clear note where it
cannot be built. Each build compiles C++ (~20 s for these tiny models)."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine import cpu_compiled
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams
from fgchat.protocol.tuning import Tuning
from test_engine import prompt_of

pytestmark = pytest.mark.skipif(not cpu_compiled.compiler_available(), reason="needs a C++ compiler")


def tokens(eng: Engine, prompt: list[int], n: int = 12) -> list[int]:
    rid = eng.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    return {e.summary.request_id: e.summary for e in eng.run_until_done()
            if isinstance(e, RequestFinished)}[rid].token_ids


def test_bf16_compiled_step_is_as_close_to_float32_as_eager(tiny_llama, tmp_path):
    """Step by step over one sequence, the compiled bf16 step's logits stay within the eager bf16
    step's distance of the float32 engine's logits (plus two bf16 steps of their scale), and so
    do the cache rows it writes."""
    ref = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                              tuning=Tuning(head_pick=False)))
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_context=256,
                              tuning=Tuning(head_pick=False)))
    path = tmp_path / "step.pt2"
    cpu_compiled.build_package(eng.decoder, eng.cache.k, eng.cache.v, path)
    step = cpu_compiled.load(path, eng.cache.k, eng.cache.v)
    seq = prompt_of(20, 3, eng.cfg.vocab_size) + tokens(ref, prompt_of(20, 3, eng.cfg.vocab_size), 10)
    worst_eager = worst_compiled = kv_eager = kv_compiled = kv_scale = 0.0
    for t in range(20, len(seq)):
        want = ref.decoder.prefill(torch.tensor(seq[: t + 1]), 0, ref.cache.k, ref.cache.v)
        eng.decoder.prefill(torch.tensor(seq[:t]), 1, eng.cache.k, eng.cache.v)
        eager = eng.decoder.prefill(torch.tensor(seq[: t + 1]), 2, eng.cache.k, eng.cache.v)
        h = step.run(torch.tensor(seq[t:t + 1]), torch.tensor([t]), torch.tensor([1]))
        got = eng.decoder.head_logits(cpu_compiled.rms_norm(h, eng.decoder.w.final_norm, eng.cfg.rms_eps))[0]
        assert torch.isfinite(got).all()
        worst_eager = max(worst_eager, float((eager.float() - want).abs().max()))
        worst_compiled = max(worst_compiled, float((got.float() - want).abs().max()))
        # row t the step wrote to slot 1 against the float32 rows, as eager's row in slot 2
        for ours, ref_cache in ((eng.cache.k, ref.cache.k), (eng.cache.v, ref.cache.v)):
            for layer, want_layer in zip(ours, ref_cache):
                row = want_layer[0, t]
                kv_eager = max(kv_eager, float((layer[2, t].float() - row).abs().max()))
                kv_compiled = max(kv_compiled, float((layer[1, t].float() - row).abs().max()))
                kv_scale = max(kv_scale, float(row.abs().max()))
    scale = float(want.abs().max())
    assert worst_compiled <= worst_eager + 2 * scale * 2**-8, (worst_compiled, worst_eager, scale)
    assert kv_compiled <= kv_eager + 2 * kv_scale * 2**-8, (kv_compiled, kv_eager, kv_scale)


def test_engine_builds_the_step_in_a_child_then_loads_it_and_reuses_it(tiny_llama, tmp_path, monkeypatch):
    """An engine with cpu_compile serves eagerly while a child builds the package, then runs
    batch-1 steps through it with transformers' float32 greedy tokens; a second engine on the same
    weights loads the package at once; other weights get another package."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    cfg = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                       tuning=Tuning(cpu_compile=True))
    eng = Engine(cfg)
    assert eng.cpu_step is not None and eng.cpu_step.building and eng.info().cpu_step == "compiling"
    assert any("compiling the CPU step" in n for n in eng.notes)
    prompt = prompt_of(11, 5, eng.cfg.vocab_size)
    eager = tokens(eng, prompt)
    assert eng.poll_cpu_step(wait=True), eng.cpu_step.failed
    assert eng.program.compiled is not None and eng.info().cpu_step == "compiled"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    calls = []
    run = eng.program.compiled.run
    eng.program.compiled.run = lambda *a: calls.append(1) or run(*a)
    assert tokens(eng, prompt) == want == eager
    assert len(calls) == 11  # every decode step after the prefill's token
    again = Engine(cfg)
    assert again.program.compiled is not None and not again.cpu_step.building
    assert "batch-1 steps run the compiled CPU step" in again.notes
    assert tokens(again, prompt) == want
    other = cpu_compiled.fingerprint(Engine(EngineConfig(preset="tiny", device="cpu", dtype="float32",
                                                         max_context=256)).decoder, tuple(eng.cache.k[0].shape))
    assert other != eng.cpu_step.key


def together(eng: Engine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    rids = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    return [done[r].token_ids for r in rids]


def test_a_batch_asks_for_the_batch_package_whose_lanes_each_give_the_float32_tokens(
        tiny_llama, tmp_path, monkeypatch):
    """A batch that ran eagerly asks for the batch package, built once batch 1's is loaded; then
    batches of 3 and 8 run through it (3 beside 5 empty lanes in the scratch slot), each sequence
    with transformers' float32 greedy tokens, and the slots outside the batch keep their bytes."""
    transformers = pytest.importorskip("transformers")
    from fgchat.engine.kv_cache import NUM_SLOTS

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                              tuning=Tuning(cpu_compile=True, prefix_reuse=False)))
    assert eng.cache.k[0].shape[0] == NUM_SLOTS + 1  # the scratch slot
    assert eng.poll_cpu_step(wait=True) and eng.program.compiled is not None
    prompts = [prompt_of(6 + 5 * i, 40 + i, eng.cfg.vocab_size) for i in range(NUM_SLOTS)]
    eager = together(eng, prompts[:3])
    assert eng.program.lanes_wanted and eng.cpu_batch_step is None
    from fgchat.tui.latency_panel import LatencyPanel, PanelView

    def line() -> str:  # the console's engine line
        return str(LatencyPanel._engine_info(PanelView(info=eng.info(), engine_state="ready")))

    assert not eng.poll_cpu_step() and eng.info().cpu_step == "compiled+compiling"
    assert "compiled step · compiling batch step…" in line()
    assert eng.poll_cpu_step(wait=True), eng.cpu_batch_step.failed
    assert eng.program.compiled_lanes is not None and eng.info().cpu_step == "compiled+batch"
    assert "compiled steps" in line() and "compiling" not in line()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    calls = []
    run = eng.program.compiled_lanes.run
    eng.program.compiled_lanes.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    others = eng.cache.all[:, 3:NUM_SLOTS].clone()
    assert together(eng, prompts[:3]) == want[:3] == eager
    assert calls == [3] * 11  # every decode step after the prefill's token
    assert torch.equal(eng.cache.all[:, 3:NUM_SLOTS].view(torch.int32), others.view(torch.int32))
    assert together(eng, prompts) == want
    assert calls[11:] == [8] * 11


def test_without_a_compiler_the_engine_says_so_and_stays_eager(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_compiled, "compiler_available", lambda: False)
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                              tuning=Tuning(cpu_compile=True)))
    assert eng.program.compiled is None and not eng.cpu_step.building and eng.info().cpu_step == "eager"
    assert any(n.startswith("compiled CPU step off: no C++ compiler") for n in eng.notes)
    assert len(tokens(eng, prompt_of(5, 1, eng.cfg.vocab_size), 4)) == 4


def test_the_engine_loop_loads_the_built_step_while_idle_and_says_so(tiny_llama, tmp_path, monkeypatch):
    """The engine process's loop (process.serve) with the engine process's tuning: the build runs
    beside the idle loop, the step is loaded by an idle pass, and an EngineInfo says so; a request
    after that decodes through it."""
    import time

    from fgchat.engine.process import engine_process_config, serve
    from fgchat.protocol.events import EngineInfo

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FGCHAT_CPU_COMPILE", "1")
    cfg = engine_process_config(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256))
    assert cfg.tuning.cpu_compile and cfg.tuning.idle_capture
    sent: list[list] = []
    engines: list[Engine] = []
    deadline = time.monotonic() + 240

    def make() -> Engine:
        engines.append(Engine(cfg))
        return engines[0]

    def next_command(timeout):
        notes = [n for batch in sent for e in batch if isinstance(e, EngineInfo) for n in e.notes]
        if "batch-1 steps run the compiled CPU step" in notes or time.monotonic() > deadline:
            raise SystemExit
        if timeout is None:
            time.sleep(0.05)
        return None

    try:
        serve(make, next_command, sent.append)
    except SystemExit:
        pass
    eng = engines[0]
    assert eng.program.compiled is not None, eng.notes
    infos = [e for batch in sent for e in batch if isinstance(e, EngineInfo)]
    assert any("compiling the CPU step" in n for n in infos[0].notes) and infos[0].cpu_step == "compiling"
    assert "batch-1 steps run the compiled CPU step" in infos[-1].notes and infos[-1].cpu_step == "compiled"
    from fgchat.tui.latency_panel import LatencyPanel, PanelView

    shown = [str(LatencyPanel._engine_info(PanelView(info=i, engine_state="ready"))) for i in (infos[0], infos[-1])]
    assert "compiling step…" in shown[0] and "compiled step" in shown[1]
    calls = []
    run = eng.program.compiled.run
    eng.program.compiled.run = lambda *a: calls.append(1) or run(*a)
    assert len(tokens(eng, prompt_of(9, 2, eng.cfg.vocab_size), 5)) == 5 and len(calls) == 4


def test_prune_keeps_the_most_recently_used_packages(tmp_path):
    import os

    for i in range(5):
        for suffix in (".pt2", ".json", ".log"):
            (tmp_path / f"k{i}{suffix}").write_text("x")
        os.utime(tmp_path / f"k{i}.pt2", (1000 + i, 1000 + i))
    cpu_compiled.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3.json", "k3.log", "k3.pt2", "k4.json", "k4.log", "k4.pt2"]


def test_a_build_that_failed_is_not_tried_again_for_the_same_weights(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    cfg = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                       tuning=Tuning(cpu_compile=True))
    probe = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256))
    slots, *rest = probe.cache.k[0].shape
    key = cpu_compiled.fingerprint(probe.decoder, (slots + 1, *rest))  # the compiling engine's scratch slot
    marker = cpu_compiled.package_path(tmp_path, key).with_suffix(".failed")
    marker.parent.mkdir(parents=True)
    marker.write_text("RuntimeError: the compiled step left the eager decoder's logits")
    eng = Engine(cfg)
    assert not eng.cpu_step.building and eng.info().cpu_step == "eager"
    assert any(n.startswith("compiled CPU step off: its build failed before: RuntimeError") for n in eng.notes)


@pytest.mark.timeout(240)
async def test_the_console_shows_the_step_compiling_then_compiled_and_a_reply_runs_it(
        tiny_llama, tmp_path, monkeypatch):
    """The real app with its engine process (Pilot): the engine line says the CPU step is being
    compiled, then that it runs compiled, and a chat reply streams after that."""
    from test_tui import make_app, panel, type_prompt, wait_for, wait_ready

    monkeypatch.setenv("FGCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FGCHAT_CPU_COMPILE", "1")  # the engine process inherits it
    app = make_app(tiny_llama, max_tokens=24, max_context=256)
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_ready(pilot, app)
        await wait_for(pilot, lambda: "compiling step…" in panel(app).text_of("engine-info"),
                       "the engine line saying the step is being compiled", 10)
        await wait_for(pilot, lambda: "compiled step" in panel(app).text_of("engine-info"),
                       "the compiled step loaded", 180)
        assert app.link.info.cpu_step == "compiled"
        conv = app.chats.current.conversation
        await type_prompt(pilot, "Hello there")
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "the reply", 60)
        assert conv.messages[-1].meta["tokens"] == 24 and conv.messages[-1].content


def test_an_unwritable_cache_directory_leaves_the_engine_eager_with_one_note(tiny_llama, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(blocked))
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256,
                              tuning=Tuning(cpu_compile=True)))
    assert eng.cpu_step is None and eng.info().cpu_step == "eager"
    assert [n for n in eng.notes if n.startswith("compiled CPU step off:")]
    assert len(tokens(eng, prompt_of(5, 1, eng.cfg.vocab_size), 4)) == 4


def test_the_bench_says_why_its_cpu_step_is_eager(tiny_llama, tmp_path, monkeypatch):
    """A CPU bench whose compiled step cannot be had keeps the engine's reason in its JSON and
    prints it under the "CPU decode step" line."""
    import io

    from fgchat.bench.report import print_report
    from fgchat.bench.runner import run_all
    from fgchat.bench.spec import BenchSpec

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FGCHAT_CPU_COMPILE", "1")  # the bench's default; the test session turns it off
    monkeypatch.setattr(cpu_compiled, "compiler_available", lambda: False)
    result = run_all(BenchSpec(model=str(tiny_llama), modes=["eager"], batch_sizes=[1], prompt_len=8,
                               output_len=4, repeats=1, device="cpu", dtype="float32", progress=False))
    meta = result["meta"]
    assert meta["cpu_step"] == "eager"
    assert meta["cpu_step_off"] == ["compiled CPU step off: no C++ compiler (c++, g++ or clang++) on PATH"]
    out = io.StringIO()
    print_report(result, out)
    assert "CPU decode step: eager\n  compiled CPU step off: no C++ compiler (c++, g++ or clang++) on PATH\n" in out.getvalue()
