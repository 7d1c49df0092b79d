"""Shared fixtures: tiny random models in Hugging Face format, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# test files of one area import helpers from another area's test file (e.g. test_tui's app driver)
for _area in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    sys.path.insert(1, str(_area))

import tiny_models  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """A failed GPU test's report is printed at once: a CUDA error can abort the process (in a
    later teardown) before pytest's summary would show it."""
    if report.failed and "gpu" in report.keywords:
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny model per supported family (different seeds so they differ)."""
    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for i, fam in enumerate(tiny_models.FAMILIES):
        out[fam] = tiny_models.build_model(root / fam, fam, seed=i)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]
