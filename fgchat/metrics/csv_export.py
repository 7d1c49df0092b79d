"""CSV export of latency records (csv module, UTF-8, "\\n" line ends).

Cells: floats with 3 decimals (milliseconds, and the speculation's rates), None as an empty cell,
booleans as 1 / 0, request modes as "eager:1;full:31". Header = TOKEN_COLUMNS / REQUEST_COLUMNS,
preceded by `session_id` when the writer is given one (the TUI always is: its --log-csv and
exports carry the session id on every row, so rows of several sessions in one file stay unique).
The readers take files with or without `session_id` (and without columns added later).

Invariants:
- `write_*_csv` are atomic: the target is either untouched or holds the complete new file
  (temp file in the same directory, fsync, os.replace). No temp file is left behind on failure.
- A file written with `private=True` is 0600 from its creation on (never readable by others, not
  even for a moment); otherwise it gets the mode a plain open() would give (0666 less the umask).
- Every I/O failure surfaces as one-line `FgchatError`; nothing here mutates a `LatencyLog`, so
  the in-memory log survives any export error and the caller can retry.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fgchat.protocol.errors import FgchatError
from fgchat.metrics.records import (
    REQUEST_COLUMNS,
    SESSION_COLUMN,
    TOKEN_COLUMNS,
    LatencyLog,
    RequestRecord,
    TokenRecord,
    format_modes,
    parse_modes,
)

PathLike = str | os.PathLike[str]


# --- cells ----------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return format_modes(value)
    return str(value)


def _row(record: TokenRecord | RequestRecord, columns: Sequence[str], session_id: str = "") -> list[str]:
    return [session_id if c == SESSION_COLUMN else _cell(getattr(record, c)) for c in columns]


def _columns(base: Sequence[str], session_id: str | None) -> tuple[str, ...]:
    """The header of a file: `base`, led by session_id when the writer has one."""
    return tuple(base) if session_id is None else (SESSION_COLUMN, *base)


def _rows_text(
    records: Iterable[TokenRecord | RequestRecord],
    columns: Sequence[str],
    header: bool,
    session_id: str | None = None,
) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if header:
        writer.writerow(columns)
    for r in records:
        writer.writerow(_row(r, columns, session_id or ""))
    return buf.getvalue()


def _one_line(path: PathLike, action: str, err: BaseException) -> FgchatError:
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return FgchatError(f"cannot {action} {os.fspath(path)}: {reason}".replace("\n", " "))


def _umask() -> int:
    """Current umask without changing it (Linux /proc); 0o022 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


# --- whole-file, atomic ---------------------------------------------------------------------


def atomic_write_text(path: PathLike, text: str, private: bool = False) -> None:
    """Write `text` to path atomically (0600 when `private`); one-line FgchatError on any failure."""
    target = Path(os.path.expanduser(os.fspath(path)))
    tmp_name: str | None = None
    try:
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        )
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not private:  # mkstemp creates 0600; else the mode a plain open() would give
            os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, target)
        tmp_name = None
    except OSError as e:
        raise _one_line(path, "write", e) from e
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass


def write_tokens_csv(
    path: PathLike, records: Iterable[TokenRecord], session_id: str | None = None, private: bool = False
) -> int:
    """Write all token records (with header) atomically; returns the row count. With a
    `session_id`, a leading session_id column holds it on every row; `private`: file 0600."""
    records = list(records)
    atomic_write_text(path, _rows_text(records, _columns(TOKEN_COLUMNS, session_id), True, session_id), private)
    return len(records)


def write_requests_csv(
    path: PathLike, records: Iterable[RequestRecord], session_id: str | None = None, private: bool = False
) -> int:
    """Write all request records (with header) atomically; returns the row count. With a
    `session_id`, a leading session_id column holds it on every row; `private`: file 0600."""
    records = list(records)
    atomic_write_text(path, _rows_text(records, _columns(REQUEST_COLUMNS, session_id), True, session_id), private)
    return len(records)


# --- reading back ---------------------------------------------------------------------------


def _opt_float(s: str) -> float | None:
    return None if s == "" else float(s)


def _opt_int(s: str) -> int | None:
    return None if s == "" else int(s)


# columns added after the first release: files written without any of them still read (as
# empty cells), and --log-csv keeps appending to such a file in its own columns
ADDED_COLUMNS = frozenset({"launch_ms", "endpoint", "cached_tokens", "step_id", "drafted", "draft_len",
                           "accepted_in_step", "spec_method", "spec_draft_len", "spec_proposed",
                           "spec_accepted", "spec_acceptance_rate", "spec_tokens_per_step"})


def _known_header(names: Sequence[str], columns: Sequence[str]) -> bool:
    """`names` is `columns` (optionally led by session_id), possibly without some ADDED_COLUMNS."""
    names = tuple(names)
    if names[:1] == (SESSION_COLUMN,):
        names = names[1:]
    return names == tuple(c for c in columns if c in names or c not in ADDED_COLUMNS)


def _read_rows(path: PathLike, columns: Sequence[str]) -> list[dict[str, str]]:
    try:
        with open(os.path.expanduser(os.fspath(path)), encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if not _known_header(reader.fieldnames or (), columns):
                raise FgchatError(f"{os.fspath(path)}: unexpected CSV header {reader.fieldnames}")
            return list(reader)
    except OSError as e:
        raise _one_line(path, "read", e) from e


def read_session_ids(path: PathLike) -> list[str]:
    """The session_id of every row of a tokens or requests CSV, in file order (row i belongs to
    record i of `read_tokens_csv` / `read_requests_csv`); "" for files without the column."""
    try:
        with open(os.path.expanduser(os.fspath(path)), encoding="utf-8", newline="") as f:
            names = next(csv.reader(f), [])
    except OSError as e:
        raise _one_line(path, "read", e) from e
    columns = TOKEN_COLUMNS if _known_header(names, TOKEN_COLUMNS) else REQUEST_COLUMNS
    return [r.get(SESSION_COLUMN) or "" for r in _read_rows(path, columns)]


def read_tokens_csv(path: PathLike) -> list[TokenRecord]:
    """Token records from a file written by `write_tokens_csv` / `CsvAppender` (ms at 3 decimals)."""
    rows = _read_rows(path, TOKEN_COLUMNS)
    try:
        return [
            TokenRecord(
                request_id=int(r["request_id"]),
                chat_id=r["chat_id"],
                token_index=int(r["token_index"]),
                mode=r["mode"],
                batch_size=int(r["batch_size"]),
                t_ms=float(r["t_ms"]),
                itl_ms=_opt_float(r["itl_ms"]),
                gpu_step_ms=_opt_float(r["gpu_step_ms"]),
                is_first_token=r["is_first_token"].strip().lower() in ("1", "true"),
                prompt_tokens=int(r["prompt_tokens"]),
                position=int(r["position"]),
                launch_ms=_opt_float(r.get("launch_ms") or ""),
                endpoint=r.get("endpoint") or "",
                step_id=int(r.get("step_id") or -1),
                drafted=(r.get("drafted") or "").strip().lower() in ("1", "true"),
                draft_len=int(r.get("draft_len") or 0),
                accepted_in_step=int(r.get("accepted_in_step") or 0),
                spec_method=r.get("spec_method") or "",
            )
            for r in rows
        ]
    except (ValueError, TypeError) as e:
        raise _one_line(path, "parse", e) from e


def read_requests_csv(path: PathLike) -> list[RequestRecord]:
    """Request records from a file written by `write_requests_csv`."""
    rows = _read_rows(path, REQUEST_COLUMNS)
    try:
        return [
            RequestRecord(
                request_id=int(r["request_id"]),
                chat_id=r["chat_id"],
                modes=parse_modes(r["modes"]),
                batch_size_max=_opt_int(r["batch_size_max"]),
                prompt_tokens=int(r["prompt_tokens"]),
                output_tokens=int(r["output_tokens"]),
                ttft_ms=float(r["ttft_ms"]),
                tpot_ms=_opt_float(r["tpot_ms"]),
                e2e_ms=float(r["e2e_ms"]),
                finish_reason=r["finish_reason"],
                endpoint=r.get("endpoint") or "",
                cached_tokens=int(r.get("cached_tokens") or 0),
                spec_method=r.get("spec_method") or "",
                spec_draft_len=_opt_int(r.get("spec_draft_len") or ""),
                spec_proposed=_opt_int(r.get("spec_proposed") or ""),
                spec_accepted=_opt_int(r.get("spec_accepted") or ""),
                spec_acceptance_rate=_opt_float(r.get("spec_acceptance_rate") or ""),
                spec_tokens_per_step=_opt_float(r.get("spec_tokens_per_step") or ""),
            )
            for r in rows
        ]
    except (ValueError, TypeError) as e:
        raise _one_line(path, "parse", e) from e


# --- live appender (--log-csv) --------------------------------------------------------------


class CsvAppender:
    """Appends token rows to `path` as they happen (for `--log-csv PATH`).

    With a `session_id` (the TUI always passes one) every row starts with it: the header is
    "session_id,request_id,...". The header is written once: only when the file is new or empty.
    An existing non-empty file must start with the same header, or with it less some
    ADDED_COLUMNS (rows are then written in the file's own columns); anything else is
    FgchatError, so two formats never mix in one file (a file from before session ids is
    refused, not rewritten, because another process may still be appending to it).
    Each `append` / `sync` call writes its batch in one write and flushes. Opening happens in the
    constructor so a bad path fails at start-up. Thread-safe. Use it as a context manager or
    call `close()`. `private`: a file this appender creates is 0600 (else a plain open()'s mode);
    an existing file keeps its mode.
    """

    def __init__(self, path: PathLike, session_id: str | None = None, private: bool = False) -> None:
        self.path = Path(os.path.expanduser(os.fspath(path)))
        self.session_id = session_id
        self.private = private
        self.columns = _columns(TOKEN_COLUMNS, session_id)
        self._lock = threading.Lock()  # guards the file
        self._sync_lock = threading.Lock()  # guards _synced; taken before _lock, never after
        self._synced = 0  # LatencyLog token index up to which `sync` has written
        self.rows_written = 0
        self._file = self._open()

    def _open(self) -> io.TextIOWrapper:
        header = _rows_text((), self.columns, header=True)
        try:
            needs_newline = False
            size = self.path.stat().st_size if self.path.exists() else 0
            if size > 0:
                with open(self.path, encoding="utf-8", newline="") as f:
                    first = f.readline()
                names = next(csv.reader([first]), [])
                with_session = (names[:1] == [SESSION_COLUMN]) == (self.session_id is not None)
                if with_session and _known_header(names, TOKEN_COLUMNS):
                    self.columns = tuple(names)  # an older file: its columns, never two formats
                elif first.rstrip("\r\n") != header.rstrip("\n"):
                    if self.session_id is not None and _known_header(names, TOKEN_COLUMNS):
                        raise FgchatError(
                            f"{self.path} was written without the session_id column (an older "
                            "fgchat); rows of two formats are never mixed: choose another file "
                            "or move this one away"
                        )
                    raise FgchatError(
                        f"{self.path} holds other data (CSV header differs); choose another file"
                    )
                with open(self.path, "rb") as fb:
                    fb.seek(-1, os.SEEK_END)
                    needs_newline = fb.read(1) != b"\n"  # last row was cut short: end it
            mode = 0o600 if self.private else 0o666
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
            f = open(fd, "a", encoding="utf-8", newline="")
            try:
                if size == 0:
                    f.write(header)
                elif needs_newline:
                    f.write("\n")
                f.flush()
            except OSError:
                f.close()
                raise
            return f
        except OSError as e:
            raise _one_line(self.path, "open log file", e) from e

    def append(self, records: Iterable[TokenRecord]) -> int:
        """Append rows and flush; returns how many. FgchatError on I/O failure."""
        records = list(records)
        if not records:
            return 0
        text = _rows_text(records, self.columns, header=False, session_id=self.session_id)
        with self._lock:
            if self._file.closed:
                raise FgchatError(f"log file {self.path} is already closed")
            try:
                self._file.write(text)
                self._file.flush()
            except OSError as e:
                raise _one_line(self.path, "append to", e) from e
            self.rows_written += len(records)
        return len(records)

    def sync(self, log: LatencyLog) -> int:
        """Append the tokens `log` gained since the last successful sync; returns how many.

        The position only advances after a successful write, so a failed sync is retried in full
        by the next one (a write that failed midway may leave a partial row, ended on reopen).
        Use either `sync` or `append` on one appender, not both.
        """
        with self._sync_lock:  # one sync at a time: no row is written twice by racing syncs
            pending = log.tokens_since(self._synced)
            written = self.append(pending)
            self._synced += written
            return written

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.close()
                except OSError as e:
                    raise _one_line(self.path, "close", e) from e

    def __enter__(self) -> CsvAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_dict(record: TokenRecord | RequestRecord) -> dict[str, Any]:
    """Field -> value of a record (column order), e.g. for JSON output."""
    return dataclasses.asdict(record)
