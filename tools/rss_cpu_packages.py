"""RSS of a CPU engine (the embedded model, bf16) with the compiled batch-1 package loaded, then with
the batch package too (engine.cpu_compiled); builds either where the cache has none.
Usage: python tools/rss_cpu_packages.py"""

from __future__ import annotations


def rss() -> str:
    with open("/proc/self/status") as f:
        fields = {line.split(":")[0]: line.split(":")[1].strip() for line in f}
    return f"RSS {fields['VmRSS']} (anon {fields['RssAnon']}, file {fields['RssFile']})"


def main() -> None:
    import torch

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import SamplingParams
    from fgchat.protocol.tuning import Tuning

    eng = Engine(EngineConfig(device="cpu", dtype="bfloat16", max_context=2048, tuning=Tuning(cpu_compile=True)))
    eng.poll_cpu_step(wait=True)

    def turn(b: int) -> None:
        for _ in range(b):
            eng.submit(torch.randint(3, 40000, (200,)).tolist(), SamplingParams(max_tokens=16, ignore_eos=True))
        eng.run_until_done()

    turn(1)
    turn(3)
    print("batch-1 package loaded, after a turn of 1 and of 3 (eager):", rss(), flush=True)
    eng.want_cpu_batch_step()
    eng.poll_cpu_step(wait=True)
    assert eng.program.compiled_lanes is not None, eng.notes
    turn(3)
    print("batch package loaded too, after a turn of 3 through it:", rss(), flush=True)


if __name__ == "__main__":
    main()
