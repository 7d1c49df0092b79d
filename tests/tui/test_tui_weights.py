"""The console names the weights: the title shows their format beside the mode, the panel the
bytes a decode step reads and the share of the GPU's peak bandwidth the latest steps reached
(n/a without a known peak, as on CPU; nothing for a remote endpoint). The real app with a real
tiny engine on CPU, its numbers checked against the model file's own tensor sizes."""

from __future__ import annotations

import torch
from tiny_models import file_weight_bytes
from test_tui import SIZE, data_dir, make_app, panel, type_prompt, wait_for, wait_ready  # noqa: F401

from fgchat.engine.devices import pick_dtype
from fgchat.protocol.events import EngineInfo, TokenEvent
from fgchat.tui.latency_console import STATS_WINDOW_TOKENS, LatencyConsole, PanelStatus
from fgchat.tui.latency_panel import LatencyPanel, PanelView


async def test_title_names_the_format_and_the_panel_the_bytes(tiny_llama, data_dir):  # noqa: F811
    app = make_app(tiny_llama, max_tokens=8, thread=True)
    dtype = pick_dtype(None, torch.device("cpu"))
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    total, step = file_weight_bytes(tiny_llama, dtype)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        info = app.link.info
        assert (info.weights, info.weight_bytes, info.step_bytes) == (name, total, step)
        assert info.peak_bandwidth is None  # CPU
        await wait_for(pilot, lambda: f"eager · {name} · batch" in app.sub_title, "the format in the title")
        await type_prompt(pilot, "Hello")
        await wait_for(pilot, lambda: app.latency.log.token_count >= 8, "the reply")
        await wait_for(pilot, lambda: f"{step / 1e6:.1f} MB" in panel(app).text_of("weights-line"), "the bytes")
        line = panel(app).text_of("weights-line")
        print(f"title: {app.sub_title!r}; panel: {line!r}")
        assert line.endswith("bandwidth n/a")


def _info(**kw) -> EngineInfo:
    base = dict(model_name="m", architecture="llama", device="NVIDIA H100 80GB HBM3", dtype="bfloat16",
                max_context=64, num_layers=2, attention_backend="triton", available_modes={}, mode="full")
    return EngineInfo(**(base | kw))


def test_share_of_peak_bandwidth():
    info = _info(weights="Q4_1", weight_bytes=98_400_000, step_bytes=80_000_000, peak_bandwidth=3.35e12)
    line = LatencyPanel._weights_line(PanelView(info=info, recent_gpu_ms=0.05), 60).plain
    share = 80_000_000 / 0.05e-3 / 3.35e12  # 0.4776
    assert line == f"weights read/step 80.0 MB  {share * 100:.0f}% of 3.35 TB/s peak BW", line
    before = LatencyPanel._weights_line(PanelView(info=info), 60).plain  # no step timed yet
    assert before == "weights read/step 80.0 MB  bandwidth –"
    narrow = LatencyPanel._weights_line(PanelView(info=info, recent_gpu_ms=0.05), 40).plain
    assert narrow == "weights/step 80.0 MB  48% peak BW"


def test_an_endpoint_shows_no_weights():
    remote = _info(endpoint="http://127.0.0.1:8000/v1", mode="remote")
    assert LatencyPanel._weights_line(PanelView(info=remote), 60).plain == ""
    assert LatencyPanel._weights_line(PanelView(info=None), 60).plain == ""


def _token(rid: int, index: int, gpu: float | None) -> TokenEvent:
    return TokenEvent(request_id=rid, token_index=index, token_id=5, text="x", mode="full", batch_size=1,
                      t_ns=index, itl_ms=None if index == 0 else 1.0, gpu_step_ms=gpu,
                      is_first_token=index == 0, position=10 + index)


def test_recent_gpu_time_is_the_stats_windows_decode_steps():
    """The bandwidth share's step time: the mean GPU time of the stats window's decode steps
    (first tokens come from the prefill, not a step)."""
    console = LatencyConsole()
    assert console.build(PanelStatus()).recent_gpu_ms is None
    n = STATS_WINDOW_TOKENS
    old = [_token(1, i, 9.0 if i else 50.0) for i in range(n)]
    new = [_token(2, i, None if i == 0 else 0.5 + 0.001 * i) for i in range(n // 2)]
    console.record_tokens(old + new, lambda rid: "c")
    window = (old + new)[-n:]
    expect = [t.gpu_step_ms for t in window if not t.is_first_token and t.gpu_step_ms is not None]
    assert abs(console.build(PanelStatus()).recent_gpu_ms - sum(expect) / len(expect)) < 1e-9
