"""The CPU correctness table (bench.real_weights.run_cpu) on the tiny model: fgchat's CPU path
against transformers on CPU, float32 and bf16."""

from fgchat.bench.real_weights import PROMPTS, equal_to, run_cpu


def test_cpu_table_float32_equals_transformers(tiny_llama):
    r = run_cpu(str(tiny_llama), tokens=6)
    assert set(r["runs"]) == {"fgchat eager float32", "fgchat eager bfloat16",
                              "transformers float32", "transformers bfloat16"}
    for run in r["runs"].values():
        assert len(run) == len(PROMPTS) and all(0 < len(toks) <= 6 for toks in run)
    assert equal_to(r, "fgchat eager float32", "transformers float32") == len(PROMPTS)
    assert r["check"]["bfloat16"]["startup_check"].passed
