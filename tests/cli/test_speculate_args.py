"""--speculate, --draft and --draft-len on the chat, `generate`, `bench` and `serve`: bad
combinations are one line before anything loads; good ones reach the engine's config; `generate
--speculate oracle` drafts from a plain run first and `--json` carries "spec"."""

from __future__ import annotations

import json

import pytest
from test_cli_bad_input import assert_one_line_error, run_main, tiny  # noqa: F401
from test_quantize_args import captured  # noqa: F401

ENTRIES = {"chat": [], "generate": ["generate", "--prompt", "hi"], "serve": ["serve"]}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_speculation_reaches_the_engine_config(capsys, captured, entry):  # noqa: F811
    assert run_main(capsys, [*ENTRIES[entry], "--speculate", "draft", "--draft", "preset:tiny",
                             "--draft-len", "6"])[0] == 0
    c = captured[entry]
    assert (c.speculate, c.draft, c.draft_len) == ("draft", "preset:tiny", 6)


@pytest.mark.parametrize("argv,needle", [
    (["--draft", "m"], "--draft needs --speculate draft"),
    (["--speculate", "ngram", "--draft", "m"], "--draft needs --speculate draft"),
    (["--speculate", "draft"], "--speculate draft needs --draft MODEL"),
    (["--draft-len", "0"], "draft length must be in 1..8, got 0"),
    (["--draft-len", "9"], "draft length must be in 1..8, got 9"),
    (["--speculate", "medusa"], "invalid choice: 'medusa'"),
])
@pytest.mark.parametrize("entry", list(ENTRIES) + ["bench"])
def test_bad_speculation_options_are_one_line(capsys, captured, entry, argv, needle):  # noqa: F811
    rc, _, err = run_main(capsys, [*ENTRIES.get(entry, ["bench"]), *argv])
    assert_one_line_error(rc, err, needle)
    assert not captured


@pytest.mark.parametrize("entry", ["chat", "serve"])
def test_the_oracle_is_for_bench_and_generate(capsys, captured, entry):  # noqa: F811
    rc, _, err = run_main(capsys, [*ENTRIES[entry], "--speculate", "oracle"])
    assert_one_line_error(rc, err, "--speculate oracle is for `fgchat bench` and `fgchat generate`")
    rc, _, err = run_main(capsys, ["--endpoint", "http://127.0.0.1:9/v1", "--speculate", "ngram"])
    assert_one_line_error(rc, err, "speculation runs in the local engine")


def test_generate_oracle_json_carries_spec(capsys, tiny):  # noqa: F811
    argv = ["generate", "--model", str(tiny), "--device", "cpu", "--prompt", "hello there", "--greedy",
            "--max-tokens", "12", "--json"]
    rc, out, _ = run_main(capsys, argv + ["--raw"])
    plain = json.loads(out)
    assert rc == 0 and plain["spec"] is None
    rc, out, _ = run_main(capsys, argv + ["--raw", "--speculate", "oracle", "--draft-len", "3"])
    got = json.loads(out)
    assert rc == 0 and got["token_ids"] == plain["token_ids"]
    spec = got["spec"]
    assert set(spec) == {"method", "draft_len", "proposed", "accepted", "acceptance_rate", "tokens_per_step",
                         "paused_for_cost"}
    assert spec["method"] == "oracle" and spec["draft_len"] == 3
    if got["output_tokens"] > 2:
        assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_step"] > 1.0
