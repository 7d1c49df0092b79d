"""Getting the latency log onto disk: the ctrl+s export (tokens + requests CSVs) and the
incremental --log-csv sync. Both carry the app's session id on every row.

ctrl+s proposes <data dir>/exports/ (created on export), never the current directory; a folder
the user typed instead is remembered for the next export. The latest export's path is shown in
the latency console.

Invariant: a failed write never loses rows; the log stays in memory and the user is told
(for --log-csv once per failure streak, with a notice when it recovers).
"""

from __future__ import annotations

import time
from pathlib import Path

from fgchat.protocol.errors import FgchatError
from fgchat.metrics import write_requests_csv, write_tokens_csv
from fgchat.tui.dialogs import ExportScreen


class ExportMixin:
    """FgchatApp's export and --log-csv syncing (`self.appender`, `self._csv_error`)."""

    @property
    def default_export_dir(self) -> Path:
        """<data dir>/exports: where ctrl+s writes unless the user chose another folder."""
        return Path(self.data_path) / "exports"

    def export_folder(self) -> Path:
        """The folder ctrl+s proposes: the last one the user typed, else the default."""
        chosen = self.settings.get("export_folder")  # (the old "export_dir" key may hold the cwd)
        return Path(chosen) if chosen else self.default_export_dir

    def action_export(self) -> None:
        default = self.export_folder() / time.strftime("fgchat-%Y%m%d-%H%M%S-tokens.csv")
        self.push_screen(ExportScreen(str(default)), self._export_chosen)

    def _export_chosen(self, path: str | None) -> None:
        if path:
            self.export_log(path)

    def export_log(self, path: str | Path) -> tuple[Path, Path] | None:
        """Write the tokens CSV at `path` and the requests CSV beside it (both atomic).
        On failure: an error notification; the log stays in memory for another try."""
        tokens_path = Path(str(path)).expanduser()
        stem = tokens_path.stem.removesuffix("-tokens")
        requests_path = tokens_path.with_name(f"{stem}-requests{tokens_path.suffix or '.csv'}")
        tokens, requests = self.latency_log.snapshot()
        default_dir = self.default_export_dir
        if tokens_path.parent == default_dir:  # only fgchat's own folder is created on the fly
            try:
                default_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError:
                pass  # the write below fails with a one-line reason
        session = self.session_id  # a leading session_id column: exports of two runs can be merged
        try:
            n_tokens = write_tokens_csv(tokens_path, tokens, session_id=session)
            n_requests = write_requests_csv(requests_path, requests, session_id=session)
        except FgchatError as exc:
            self.notify(f"{exc} — the log is kept in memory; export again to another path",
                        title="export failed", severity="error", timeout=10)
            return None
        folder = tokens_path.parent.resolve()
        if folder != default_dir.resolve():
            self.settings.set("export_folder", str(folder))
        elif self.settings.get("export_folder"):
            self.settings.set("export_folder", None)
        self.last_export_path = str(tokens_path)
        self._dirty = True  # the console shows the path
        self.notify(f"{n_tokens} token rows → {tokens_path}\n{n_requests} request rows → {requests_path}",
                    title="latency log exported", timeout=6)
        return tokens_path, requests_path

    def _sync_csv(self) -> None:
        try:
            self.appender.sync(self.latency_log)
            if self._csv_error:
                self._csv_error = ""
                self.notify("the --log-csv file is writable again; rows caught up", timeout=4)
        except FgchatError as exc:
            if not self._csv_error:
                self.notify(f"{exc} (rows stay in memory; retrying)", title="--log-csv", severity="error")
            self._csv_error = str(exc)
