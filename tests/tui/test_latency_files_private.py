"""Latency CSVs under the data directory are private (0600) like everything else there: ctrl+s
exports to <data dir>/exports and the log kept at exit in <data dir>/latency. A path the user
picks outside the data directory gets a plain file's mode (0666 less the umask)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fgchat.tui.log_files import LogFiles
from fgchat.tui.store import Settings
from test_metrics import _filled_log


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def log_files(data: Path) -> LogFiles:
    return LogFiles(_filled_log(), Settings(data / "settings.json"), data, None, lambda *a, **k: None)


def test_latency_csvs_in_the_data_dir_are_0600(tmp_path, umask022):
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    files = log_files(data)
    exported = files.export(files.proposed_path())
    assert exported is not None and exported[0].parent == data / "exports"
    assert [mode_of(p) for p in exported] == [0o600, 0o600]

    (tmp_path / "mine").mkdir()
    elsewhere = files.export(tmp_path / "mine" / "run-tokens.csv")
    assert elsewhere is not None and [mode_of(p) for p in elsewhere] == [0o644, 0o644]

    files = log_files(data)  # nothing exported yet: the whole log is kept at exit
    kept = files.keep_at_exit()
    assert kept is not None and kept.parent == data / "latency"
    requests = kept.with_name(kept.name.replace("-tokens", "-requests"))
    assert [mode_of(kept), mode_of(requests)] == [0o600, 0o600]


def test_log_csv_inside_the_data_dir_is_0600(tmp_path, umask022, monkeypatch):
    """--log-csv creates its file 0600 under the data directory, a plain file's mode elsewhere."""
    from fgchat.metrics import CsvAppender
    from fgchat.tui import _in_data_dir

    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    monkeypatch.setenv("FGCHAT_DATA_DIR", str(data))
    inside, outside = data / "live.csv", tmp_path / "live.csv"
    for path in (inside, outside):
        CsvAppender(path, session_id="s", private=_in_data_dir(path)).close()
    assert (mode_of(inside), mode_of(outside)) == (0o600, 0o644)
