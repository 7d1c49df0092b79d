"""`fgchat bench --prompts SET`: the built-in sets load and render as user messages in the model's
chat template; a bench run on a tiny model with `--prompts grounded --speculate off,ngram` gives
plain and speculated rows that generate the same tokens, the speculated ones with accepted drafts,
and the JSON names the set; bad sets and bad combinations are one line, exit 2."""

from __future__ import annotations

import json

import pytest
from test_cli_bad_input import assert_one_line_error, run_main

from fgchat.bench.prompt_sets import BUILTIN, batch_prompts, prompt_texts, render_prompts, split_prompts

TINY_BENCH = ["bench", "--device", "cpu", "--modes", "eager", "--output-len", "24", "--repeats", "1",
              "--warmup", "0", "--no-progress"]


@pytest.fixture(autouse=True)
def _quiet_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bench sets it; restored after each test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_blocks_between_blank_lines():
    text = "first\n  indented line\n\n \t \r\nsecond\r\n\n\n\nthird  \n    code()\n"
    assert split_prompts(text) == ["first\n  indented line", "second", "third\n    code()"]
    assert split_prompts("\n \n\t\n") == []


def test_builtin_sets_have_input_to_copy_or_none():
    grounded, open_ = prompt_texts("grounded"), prompt_texts("open")
    assert BUILTIN == ("grounded", "open") and len(grounded) >= 6 and len(open_) >= 6
    for text in grounded:  # an instruction line, then 80..200 words (or 20+ lines) of input to repeat or edit
        body = text.split("\n", 1)[1]
        assert len(body.split()) >= 80 or body.count("\n") >= 20, text[:60]
        assert len(body.split()) <= 200, text[:60]
    assert all(len(t.split()) < 30 and "\n" not in t for t in open_)
    assert len(set(grounded + open_)) == len(grounded) + len(open_)


def test_sets_render_with_the_model_template(tiny_llama):
    from tokenizers import Tokenizer as Backend

    from fgchat.engine.model.tokenizer import Tokenizer

    backend = Backend.from_file(str(tiny_llama / "tokenizer.json"))  # the reference: ChatML by hand
    for name in BUILTIN:
        texts = prompt_texts(name)
        ids = render_prompts(Tokenizer.from_dir(tiny_llama), texts, name)
        want = [backend.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n").ids for t in texts]
        assert ids == want
    assert batch_prompts([[1], [2], [3]], 5) == [[1], [2], [3], [1], [2]]


def test_grounded_bench_plain_and_ngram_rows(capsys, tmp_path, tiny_llama):
    out_json = tmp_path / "r.json"
    rc, out, err = run_main(capsys, [*TINY_BENCH, "--model", str(tiny_llama), "--prompts", "grounded",
                                     "--speculate", "off,ngram", "--batch-sizes", "1,2", "--json", str(out_json)])
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    meta, runs = data["meta"], data["runs"]
    assert [(r["runner"], r["batch_size"]) for r in runs] == [
        ("fgchat-eager", 1), ("fgchat-eager", 2), ("fgchat-eager+ngram", 1), ("fgchat-eager+ngram", 2)]
    assert meta["prompts"] == "grounded" and meta["prompt_len"] is None and meta["speculate"] == ["off", "ngram"]
    from fgchat.engine.model.tokenizer import Tokenizer

    want = [len(p) for p in render_prompts(Tokenizer.from_dir(tiny_llama), prompt_texts("grounded"), "grounded")]
    assert meta["prompt_tokens"] == want
    plain = {r["batch_size"]: r for r in runs if r["speculate"] == "off"}
    spec = {r["batch_size"]: r for r in runs if r["speculate"] == "ngram"}
    for b in (1, 2):
        print(b, plain[b]["output_tokens"], spec[b]["output_tokens"], spec[b]["acceptance_rate"],
              spec[b]["tokens_per_step"])
        counts = plain[b]["output_tokens"]
        assert len(counts) == b and all(1 <= c <= 24 for c in counts)
        assert spec[b]["output_tokens"] == counts  # greedy: speculation changes no token
        assert plain[b]["acceptance_rate"] is None
    # the tiny random model repeats itself, so lookup finds drafts in its own reply if not in the prompt
    assert any((spec[b]["acceptance_rate"] or 0) > 0 and spec[b]["tokens_per_step"] > 1 for b in (1, 2))
    head = out.splitlines()[0]
    assert f"prompts grounded: 8, {min(want)}..{max(want)} tokens" in head and "prompt None" not in head
    from fgchat.bench.chart import bar_chart_svg

    assert "prompts grounded, output up to 24 tokens" in bar_chart_svg([data])


def test_a_prompts_file_cycles_over_the_batch(capsys, tmp_path, tiny_llama):
    path = tmp_path / "mine.txt"
    path.write_text("Say hello.\n\n\nRepeat: hello hello hello\n", encoding="utf-8")
    out_json = tmp_path / "r.json"
    rc, out, err = run_main(capsys, [*TINY_BENCH, "--model", str(tiny_llama), "--prompts", str(path),
                                     "--batch-sizes", "3", "--json", str(out_json)])
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert data["meta"]["prompts"] == str(path) and len(data["meta"]["prompt_tokens"]) == 2
    counts = data["runs"][0]["output_tokens"]
    assert len(counts) == 3 and counts[2] == counts[0]  # the third request is the first prompt again


@pytest.mark.parametrize("content,needle", [
    (None, "no such file (give random, grounded, open or a text file of prompts)"),
    (b"", "no prompts in it"),
    (b"\n  \n\t\n", "no prompts in it"),
    (b"caf\xe9 au lait", "not UTF-8 text (byte 0xe9 at offset 3)"),
    ("dir", "is a directory"),
])
def test_bad_prompt_files_are_one_line(capsys, tmp_path, content, needle):
    path = tmp_path / "p.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    rc, _, err = run_main(capsys, [*TINY_BENCH, "--prompts", str(path)])
    assert_one_line_error(rc, err, f"--prompts {path}: {needle}")


@pytest.mark.parametrize("argv,needle", [
    ([*TINY_BENCH, "--preset", "tiny", "--random-weights"], "random weights have none (use --prompts random)"),
    ([*TINY_BENCH, "--peers", "hf"], "--prompts grounded runs on fgchat's own engine: leave out --peers"),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1"], "runs on fgchat's own engine: leave out --endpoint"),
])
def test_sets_need_the_local_engine_and_a_tokenizer(capsys, argv, needle):
    rc, _, err = run_main(capsys, [*argv, "--prompts", "grounded"])
    assert_one_line_error(rc, err, needle)


@pytest.mark.parametrize("argv,needle", [
    (["--speculate", "off,draft"], "--speculate draft needs --draft MODEL"),
    (["--speculate", "off,ngram", "--draft", "m"], "--draft needs --speculate draft"),
    (["--speculate", "ngram,medusa"], "invalid choice: 'medusa'"),
    (["--speculate", ","], "give at least one method"),
])
def test_speculate_lists_are_checked_per_method(capsys, argv, needle):
    rc, _, err = run_main(capsys, [*TINY_BENCH, "--preset", "tiny", "--random-weights", *argv])
    assert_one_line_error(rc, err, needle)


def test_set_requests_stop_at_eos_and_random_ones_do_not():
    from test_bench_speculation import ScriptedEngine

    from fgchat.bench.runner import measure_engine
    from fgchat.bench.spec import BenchSpec

    class Recording(ScriptedEngine):
        def submit(self, prompt, params):
            self.sent.append((prompt, params))
            return super().submit(prompt, params)

    spec = BenchSpec(output_len=16, prompt_len=8, warmup=0, repeats=1)
    for prompt_set, batch in (([[5, 6, 7], [8, 9]], 3), (None, 2)):
        engine = Recording()
        engine.sent = []
        run = measure_engine(engine, "eager", batch, spec, "off", prompt_set)
        prompts = [p for p, _ in engine.sent]
        assert all(sp.max_tokens == 16 and sp.ignore_eos == (prompt_set is None) for _, sp in engine.sent)
        if prompt_set is None:
            assert len(prompts) == 2 and all(len(p) == 8 for p in prompts)
        else:
            assert prompts == [[5, 6, 7], [8, 9], [5, 6, 7]]
        assert len(run["output_tokens"]) == batch


def test_a_set_longer_than_max_context_is_one_line(capsys, tiny_llama):
    rc, _, err = run_main(capsys, [*TINY_BENCH, "--model", str(tiny_llama), "--prompts", "grounded",
                                   "--max-context", "64", "--batch-sizes", "1"])
    assert_one_line_error(rc, err, "exceed the context (64)")
