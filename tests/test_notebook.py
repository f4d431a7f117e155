"""examples/quickstart.ipynb runs top to bottom in a fresh python3 kernel, offline, and reports its PSNR; the
`taesd-fast` shell commands it suggests at the end succeed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "examples" / "quickstart.ipynb"
NOTEBOOK_EXTRA = "needs the notebook extra: pip install 'taesd_fast[notebook]'"


def outputs_text(notebook) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_quickstart_notebook_runs_offline(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason=NOTEBOOK_EXTRA)
    nbclient = pytest.importorskip("nbclient", reason=NOTEBOOK_EXTRA)
    pytest.importorskip("ipykernel", reason=NOTEBOOK_EXTRA)
    # The kernel inherits this environment: no Hub access, and the package from this checkout.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = outputs_text(notebook)
    match = re.search(r"round-trip PSNR: ([\d.]+) dB", text)
    assert match, text
    assert float(match.group(1)) > 25  # TAEF2 on this painting: ~29 dB
    assert "dispatch mode=" in text
    assert any(o.get("data", {}).get("image/png") for c in notebook.cells for o in c.get("outputs", [])), \
        "the before/after figure was not drawn"


def shell_commands(notebook: dict) -> list[list[str]]:
    """The `taesd-fast ...` lines of the notebook's markdown cells, as argument lists without their comments."""
    lines = [line for cell in notebook["cells"] if cell["cell_type"] == "markdown"
             for line in "".join(cell["source"]).splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("taesd-fast ")]


def test_quickstart_shell_commands_succeed(tmp_path, monkeypatch, capsys, hub_offline, no_network):
    pytest.importorskip("PIL", reason="the CLI's image commands need Pillow (taesd_fast[media])")
    pytest.importorskip("av", reason="taesd-fast lipsync needs PyAV (taesd_fast[media])")
    from taesd_fast.apps.cli import main

    commands = shell_commands(json.loads(NOTEBOOK.read_text()))
    assert commands, f"no taesd-fast command found in {NOTEBOOK}"
    shutil.copytree(NOTEBOOK.parent / "assets", tmp_path / "assets")  # the paths are relative to the notebook
    monkeypatch.chdir(tmp_path)
    for argv in commands:  # in order: decode reads what encode wrote
        if argv[1] == "lipsync":
            argv += ["--max-frames", "2"]  # the last value wins; 50 frames would take a minute on a CPU
        code = main(argv[1:])
        assert code == 0, f"{shlex.join(argv)} failed: {capsys.readouterr().err}"
