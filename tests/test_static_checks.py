"""Code that only a GPU runs (tests/gpu, the kernels' device paths, tools/) is imported but never executed on a
CPU machine, so an undefined or misspelt name there would pass CI and fail on the device. Pyflakes' checks (ruff's
F rules) find those without running the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyflakes_clean():
    paths = [str(ROOT / p) for p in ("taesd_fast", "tests", "tools", "examples") if (ROOT / p).exists()]
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F",
                             "--output-format", "concise", *paths], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
