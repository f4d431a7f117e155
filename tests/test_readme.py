"""The README is what a new user reads first: it stays short, says nothing of our lab notes, and its quickstart and
command lines work as written (offline, on CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_short_and_free_of_lab_notes():
    text = _text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\brun [A-Z]{1,2}[0-9]+\b", text), "benchmark run IDs belong in docs/lab-notes.md"
    assert not re.search(r"\bissue \d+", text, re.IGNORECASE), "issue names belong in the tracker"


def test_set_up_comes_before_everything_but_the_summary():
    headings = [line for line in _text().splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Install and the two commands", "## Quickstart"]


def test_quickstart_runs_offline_on_cpu(tmp_path):
    """The first Python block, as a user pastes it, with the Hub switched off and no GPU in sight."""
    block = re.search(r"```python\n(.*?)```", _text(), re.S).group(1)
    check = ("\nassert latents.shape == (1, 32, 64, 64), latents.shape"
             "\nassert decoded.shape == (1, 3, 512, 512) and 0 <= decoded.min() and decoded.max() <= 1\nprint('ok')\n")
    env = {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin",
           "TAESD_FAST_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", block + check], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_every_command_line_names_a_real_subcommand():
    from taesd_fast.apps.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    commands = re.findall(r"^taesd-fast (\w+)(?: (\w+))?", _text(), re.M)
    assert len(commands) >= 6
    for command, second in commands:
        assert command in sub.choices, command
        if command == "video":
            (video_sub,) = [a for a in sub.choices["video"]._actions if a.__class__.__name__ == "_SubParsersAction"]
            assert second in video_sub.choices, second


def test_the_demo_line_says_what_make_demo_runs():
    """The README called the default demo a 'lip-sync decode'; without --latents it is an encode-decode round trip."""
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1)
    (line,) = [line for line in _text().splitlines() if line.startswith("make demo")]
    assert "lipsync" in recipe and "--latents" not in recipe, recipe
    assert "round trip" in line and "decode of" not in line, line
    assert re.search(r"^DEMO_OUTPUT := (\S+)$", makefile, re.M).group(1) in line  # the file it names is the one written
