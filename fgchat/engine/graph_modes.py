"""The engine's graph modes: capture of piecewise / full decode graphs and of the prefill graphs,
the start-up self-check, and what happens when a capture fails (the mode is disabled with a
reason; eager always remains).

`GraphModes` is a part of `Engine` kept in its own file; it uses the engine's device, config,
tuning, decoder, cache, bufs, program, cfg, max_context, notes, mode and pending events, and owns
`runner`, `prefill_graphs`, `unavailable` and `kernel_warmup_s`.

Invariants:
- a disabled mode never comes back; its graphs are dropped and their pool memory released;
- prefill graphs serve full mode only, so disabling full drops them too;
- a failed prefill capture leaves prefill eager (same bits) and full decode graphs in place.
"""

from __future__ import annotations

import torch

from fgchat.protocol.events import ModeChanged
from fgchat.engine.kv_cache import NUM_SLOTS
from fgchat.engine.step import StepOutputs


class GraphModes:
    """Graph capture, self-check, lazy capture and mode disabling of `Engine`."""

    def _init_graphs(self) -> None:
        if self.device.type != "cuda":
            reason = "CUDA graphs need a CUDA device; this engine runs on CPU"
            self.unavailable.update(piecewise=reason, full=reason)
            return
        from fgchat.engine.graphs import GraphRunner

        self.runner = GraphRunner(self.program)
        self.unavailable.update(piecewise="", full="")
        if self.decoder.fused and self.tuning.prefill_graphs:
            from fgchat.engine.prefill_graphs import PrefillGraphs

            pool = torch.cuda.graph_pool_handle() if self.tuning.prefill_own_pool else self.runner.pool
            self.prefill_graphs = PrefillGraphs(self.decoder, self.cache.k, self.cache.v, pool,
                                                self.runner.stream)
        if not self.config.lazy_capture:
            try:
                self.kernel_warmup_s = self.runner.warm_kernels(range(1, NUM_SLOTS + 1))
            except RuntimeError as exc:  # the captures below meet the same failure and disable modes
                self.notes.append(f"kernel warm-up failed: {str(exc).splitlines()[0][:160]}")
            if self.prefill_graphs is not None and self.tuning.prefill_first:
                self._capture_prefill()
            for mode in ("piecewise", "full"):
                self._capture_mode(mode)

    def _capture_mode(self, mode: str) -> None:
        assert self.runner is not None
        try:
            for b in range(1, NUM_SLOTS + 1):
                self.runner.capture(mode, b, False)
            if self.config.self_check:
                self._self_check(mode)
            if mode == "full" and self.prefill_graphs is not None:
                self._capture_prefill()
        except torch.OutOfMemoryError:
            self._disable(mode, "out of GPU memory while capturing graphs")
        except RuntimeError as exc:  # capture failures surface as RuntimeError
            self._disable(mode, f"graph capture failed: {str(exc).splitlines()[0][:160]}")

    def _capture_prefill(self) -> None:
        """Prefill graphs for every bucket; on failure prefill stays eager (full decode stays)."""
        assert self.prefill_graphs is not None
        try:
            self.prefill_graphs.capture_all()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            self._drop_prefill_graphs(exc)

    def _drop_prefill_graphs(self, exc: Exception) -> None:
        """Prefill runs eagerly from now on (same bits); full decode graphs stay."""
        self.prefill_graphs = None
        torch.cuda.empty_cache()
        self.notes.append(f"prefill graphs disabled: {str(exc).splitlines()[0][:160]}")

    def _disable(self, mode: str, reason: str) -> None:
        self.unavailable[mode] = reason
        if mode == "full":  # prefill graphs serve full mode only (and may be captured before it)
            self.prefill_graphs = None
        if self.runner is not None:
            self.runner.drop_mode(mode)
            torch.cuda.empty_cache()
        self.notes.append(f"{mode} disabled: {reason}")

    @torch.inference_mode()
    def _self_check(self, mode: str) -> None:
        """Replay each captured size at lengths unlike capture's and compare with eager."""
        g = torch.Generator().manual_seed(1234)
        for b in range(1, NUM_SLOTS + 1):
            top = max(self.max_context - 1, 2)
            pos = torch.randint(1, min(top, 4096), (b,), generator=g).tolist()
            ids = torch.randint(0, self.cfg.vocab_size, (b,), generator=g).tolist()
            self.bufs.stage(ids, pos, list(range(b)), [0.0] * b, [1.0] * b, [0] * b, [0] * b)
            ref = self.program.run_eager(b, False)
            ref_tokens, ref_logits = ref.tokens.clone(), ref.logits.clone()
            out = self.runner.get((mode, b, False)).replay()
            ok = torch.equal(out.tokens, ref_tokens) and bool(
                torch.isfinite(out.logits).all()
            ) and torch.allclose(out.logits, ref_logits, rtol=2e-2, atol=2e-2)
            if not ok:
                self._disable(mode, f"self-check mismatch at batch size {b}")
                return

    def _prefill_logits(self, ids: torch.Tensor, slot: int) -> torch.Tensor:
        """Full mode replays a prefill graph (captured on first use of a bucket when capture is
        lazy); other modes, and prompts longer than the last bucket, prefill eagerly. Both run
        the same kernels at the same padded length."""
        graphs = self.prefill_graphs
        if (self.mode == "full" and graphs is not None and graphs.covers(ids.shape[0])
                and self.tuning.prefill_replay):
            try:
                return graphs.run(ids, slot)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # a capture failure
                self._drop_prefill_graphs(exc)
        return self.decoder.prefill(ids, slot, self.cache.k, self.cache.v)

    def _replay(self, mode: str, b: int, do_sample: bool) -> StepOutputs:
        assert self.runner is not None
        key = (mode, b, do_sample)
        if not self.runner.has(key):
            try:
                self.runner.capture(*key)
            except torch.OutOfMemoryError:
                self._disable(mode, "out of GPU memory while capturing graphs")
                self.mode = "eager"
                self._pending.append(ModeChanged("eager", f"{mode} disabled: out of memory"))
                self.program.max_len_hint = None
                return self.program.run_eager(b, do_sample)
        return self.runner.get(key).replay()
