"""Getting the latency log onto disk: the ctrl+s export (tokens + requests CSVs) and the
--log-csv sync, which runs on its own 1 s timer and once more at exit. Both carry the app's
session id on every row.

ctrl+s proposes <data dir>/exports/ (created on export), never the current directory; a folder
the user typed instead is remembered for the next export. The latest export's path is shown in
the latency console.

Invariants: a failed write never loses rows; the log stays in memory and the user is told
(for --log-csv once per failure streak, with a notice when it recovers). At exit, a log holding
rows that neither --log-csv nor an export wrote goes to <data dir>/latency/ (`keep_at_exit`).
Every CSV written under the data directory is 0600, like everything else there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fgchat.metrics import CsvAppender, LatencyLog, write_requests_csv, write_tokens_csv
from fgchat.protocol.errors import FgchatError

SYNC_S = 1.0  # --log-csv: rows reach the file at most this late (and all of them at exit)

Notify = Callable[..., None]  # App.notify's signature


class LogFiles:
    """Exports and --log-csv for one latency log; `notify` is the app's."""

    def __init__(self, log: LatencyLog, settings, data_path: Path, appender: CsvAppender | None,
                 notify: Notify) -> None:
        self.log = log
        self.settings = settings
        self.data_path = Path(data_path)
        self.appender = appender
        self._notify = notify
        self.last_export = ""  # tokens CSV of the latest ctrl+s export
        self.csv_error = ""  # the current --log-csv failure streak's reason ("" when none)
        self._written = (0, 0)  # (tokens, requests) of the log that a file already holds

    # ---- ctrl+s --------------------------------------------------------------------------
    @property
    def default_export_dir(self) -> Path:
        """<data dir>/exports: where ctrl+s writes unless the user chose another folder."""
        return self.data_path / "exports"

    def export_folder(self) -> Path:
        """The folder ctrl+s proposes: the last one the user typed, else the default."""
        chosen = self.settings.get("export_folder")
        return Path(chosen) if chosen else self.default_export_dir

    def proposed_path(self) -> Path:
        return self.export_folder() / time.strftime("fgchat-%Y%m%d-%H%M%S-tokens.csv")

    def export(self, path: str | Path) -> tuple[Path, Path] | None:
        """Write the tokens CSV at `path` and the requests CSV beside it (both atomic).
        On failure: an error notification; the log stays in memory for another try."""
        tokens_path = Path(str(path)).expanduser()
        stem = tokens_path.stem.removesuffix("-tokens")
        requests_path = tokens_path.with_name(f"{stem}-requests{tokens_path.suffix or '.csv'}")
        tokens, requests = self.log.snapshot()
        default_dir = self.default_export_dir
        if tokens_path.parent == default_dir:  # only fgchat's own folder is created on the fly
            try:
                default_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError:
                pass  # the write below fails with a one-line reason
        session = self.log.session_id  # a leading session_id column: exports of two runs can be merged
        private = self.in_data_dir(tokens_path)
        try:
            n_tokens = write_tokens_csv(tokens_path, tokens, session_id=session, private=private)
            n_requests = write_requests_csv(requests_path, requests, session_id=session, private=private)
        except FgchatError as exc:
            self._notify(f"{exc} — the log is kept in memory; export again to another path",
                         title="export failed", severity="error", timeout=10)
            return None
        self._written = (max(self._written[0], len(tokens)), max(self._written[1], len(requests)))
        folder = tokens_path.parent.resolve()
        if folder != default_dir.resolve():
            self.settings.set("export_folder", str(folder))
        elif self.settings.get("export_folder"):
            self.settings.set("export_folder", None)
        self.last_export = str(tokens_path)
        self._notify(f"{n_tokens} token rows → {tokens_path}\n{n_requests} request rows → {requests_path}",
                     title="latency log exported", timeout=6)
        return tokens_path, requests_path

    def in_data_dir(self, path: Path) -> bool:
        """Whether `path` lies under the data directory (its files are private there)."""
        try:
            return path.expanduser().resolve().is_relative_to(self.data_path.resolve())
        except (OSError, RuntimeError):  # a symlink loop: not known to be outside, keep it private
            return True

    # ---- --log-csv -----------------------------------------------------------------------
    def sync(self) -> None:
        """Append the rows the log gained since the last sync (the 1 s timer)."""
        if self.appender is None:
            return
        try:
            self.appender.sync(self.log)
            if self.csv_error:
                self.csv_error = ""
                self._notify("the --log-csv file is writable again; rows caught up", timeout=4)
        except FgchatError as exc:
            if not self.csv_error:
                self._notify(f"{exc} (rows stay in memory; retrying)", title="--log-csv", severity="error")
            self.csv_error = str(exc)

    def close(self) -> None:
        """At exit: the last rows, then the file closed. Quiet: nobody sees notifications now."""
        if self.appender is None:
            return
        try:
            self.appender.sync(self.log)
            self._written = (self.log.token_count, self.log.request_count)
        except FgchatError:
            pass
        try:
            self.appender.close()
        except FgchatError:
            pass

    # ---- at exit -------------------------------------------------------------------------
    @property
    def kept_dir(self) -> Path:
        """<data dir>/latency: where a log nothing else wrote is kept at exit."""
        return self.data_path / "latency"

    def keep_at_exit(self) -> Path | None:
        """After `close`: a log with rows that no file holds yet (no --log-csv, none since the
        last export) is written whole to <data dir>/latency/<session id>-tokens.csv and
        -requests.csv. Returns the tokens CSV's path, None when there was nothing to keep; raises
        FgchatError when it could not be written."""
        counts = (self.log.token_count, self.log.request_count)
        if counts[0] <= self._written[0] and counts[1] <= self._written[1]:  # also: an empty log
            return None
        tokens, requests = self.log.snapshot()
        try:
            self.kept_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise FgchatError(f"cannot create {self.kept_dir}: {exc.strerror or exc}") from None
        session = self.log.session_id
        name = session or time.strftime("%Y%m%dT%H%M%S")
        tokens_path = self.kept_dir / f"{name}-tokens.csv"
        write_tokens_csv(tokens_path, tokens, session_id=session, private=True)
        write_requests_csv(self.kept_dir / f"{name}-requests.csv", requests, session_id=session, private=True)
        self._written = (len(tokens), len(requests))
        return tokens_path
