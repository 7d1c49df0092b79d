"""Start-up of the TUI: what the UI process imports, the order in which the engine and the UI
start, the "ready in X s" the app shows, and tools/startup_time.py's timeline (tiny model, CPU).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fgchat.engine.process import EngineThread
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import SamplingParams

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "triton", "safetensors", "tokenizers", "jinja2", "huggingface_hub")
START_TIMEOUT = 60.0


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "data"
    monkeypatch.setenv("FGCHAT_DATA_DIR", str(path))
    return path


def _fresh_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_ui_process_imports_no_torch():
    """The UI process (cli, parser, the app) leaves torch & co. to the engine child."""
    code = (
        "import sys, json\n"
        "from fgchat.cli import build_parser\n"
        "build_parser().parse_args([])\n"
        "import fgchat.tui, fgchat.tui.app\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    assert json.loads(_fresh_python(code)) == []


def test_engine_starts_before_the_ui_is_imported():
    """build_app starts the engine first: when its start() runs, neither Textual nor the app
    has been imported (their import then overlaps the engine child's)."""
    code = (
        "import sys, json\n"
        "import fgchat.tui\n"
        "seen = {}\n"
        "class Handle:\n"
        "    started_at = None\n"
        "    def start(self):\n"
        "        seen.update(textual='textual' in sys.modules, app='fgchat.tui.app' in sys.modules)\n"
        "    def shutdown(self, timeout=5.0):\n"
        "        pass\n"
        "handle = Handle()\n"
        "app = fgchat.tui.build_app(engine_factory=lambda cfg: handle)\n"
        "seen['adopted'] = app.link.handle is handle\n"
        "print(json.dumps(seen))\n"
    )
    assert json.loads(_fresh_python(code)) == {"textual": False, "app": False, "adopted": True}


def test_launch_time_is_this_process_start():
    code = ("import time\n"
            "time.sleep(0.3)\n"
            "from fgchat.tui import launch_time\n"
            "print(time.monotonic() - launch_time())\n")
    age = float(_fresh_python(code))
    if age == 0.0:
        pytest.skip("no /proc/self/stat here: launch_time falls back to now")
    assert 0.3 <= age < 30.0


class _Recorder:
    """A handle that only notes start and shutdown."""

    started_at = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def shutdown(self, timeout: float = 5.0) -> None:
        self.calls.append(f"shutdown {timeout}")


def test_build_app_stops_the_engine_when_start_up_fails(data_dir, tmp_path):
    """An error after the engine started (here a --log-csv holding other data) stops it at once."""
    from fgchat.tui import build_app

    other = tmp_path / "other.csv"
    other.write_text("a,b,c\n1,2,3\n")
    handle = _Recorder()
    with pytest.raises(FgchatError, match="holds other data"):
        build_app(log_csv=other, engine_factory=lambda cfg: handle)
    assert handle.calls == ["start", "shutdown 0.0"]


def _tiny_app(model: Path, **kw):
    from fgchat.tui.app import FgchatApp

    config = EngineConfig(model=str(model), device="cpu", mode="eager", max_context=256)
    return FgchatApp(config, sampling=SamplingParams(max_tokens=8), **kw)


async def _wait_ready(pilot, app) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while app.link.state == "starting":
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await pilot.pause(0.02)
    assert app.link.state == "ready", app.link.error
    await pilot.pause(0.1)


async def test_ready_notice_shows_the_start_up_time(tiny_llama, data_dir):
    """The app's own engine (spawned at mount): "<model> ready in X.X s", also in the panel."""
    from fgchat.tui.latency_panel import LatencyPanel

    app = _tiny_app(tiny_llama)
    async with app.run_test(size=(120, 40)) as pilot:
        await _wait_ready(pilot, app)
        ready = [text for sev, text in app.notices if "ready in" in text]
        assert len(ready) == 1, app.notices
        match = re.fullmatch(r".+ ready in (\d+\.\d) s", ready[0])
        assert match, ready
        assert app.link.ready_s is not None and float(match[1]) == pytest.approx(app.link.ready_s, abs=0.051)
        await pilot.pause(0.3)  # the panel redraws at 10 Hz
        assert f"ready in {match[1]} s" in app.query_one(LatencyPanel).text_of("engine-info")


async def test_prestarted_engine_counts_from_the_launch(tiny_llama, data_dir):
    """An engine started before the app (as build_app does) is adopted, not started again, and
    the time shown counts from `launched_at`; a restart counts from the restart."""
    config = EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=256)
    handle = EngineThread(config)
    handle.start()
    made: list[object] = []

    def factory(cfg):
        made.append(EngineThread(cfg))
        return made[-1]

    app = _tiny_app(tiny_llama, engine=handle, engine_factory=factory, launched_at=time.monotonic() - 30.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await _wait_ready(pilot, app)
        assert app.link.handle is handle and made == []
        assert 30.0 <= app.link.ready_s < 30.0 + START_TIMEOUT
        assert any(re.fullmatch(r".+ ready in 3\d\.\d s", text) for _sev, text in app.notices), app.notices
        await app.action_restart_engine()
        await _wait_ready(pilot, app)
        assert app.link.handle is made[0]
        assert app.link.ready_s < 30.0


def test_startup_time_script_timeline(tiny_llama, tmp_path):
    """tools/startup_time.py on a tiny model: every phase is traced, the engine is spawned
    before the UI imports Textual, and the app showed its start-up time."""
    out = tmp_path / "timeline.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "startup_time.py"), "--model", str(tiny_llama), "--device", "cpu",
         "--runs", "1", "--timeout", "120", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^ready to send: median \d+ ms", proc.stdout, re.M), proc.stdout
    data = json.loads(out.read_text())
    (marks,) = data["runs"]
    order = ["script: cli parsed", "ui: engine spawned", "engine: child started", "engine: imports done",
             "engine: model loaded", "engine: built", "engine: info sent", "ui: ready"]
    assert [marks[label] for label in order] == sorted(marks[label] for label in order), marks
    assert marks["ui: engine spawned"] < marks["ui: app imported"] < marks["ui: app built"] < marks["ui: mounted"]
    assert any(re.search(r"ready in \d+\.\d s", text) for text in data["results"][0]["notices"])
