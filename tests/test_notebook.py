"""examples/quickstart.ipynb runs top to bottom in a fresh python3 kernel, offline, and reports its PSNR."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the notebook extra: pip install 'taesd_fast[notebook]'")
nbclient = pytest.importorskip("nbclient", reason="needs the notebook extra: pip install 'taesd_fast[notebook]'")
pytest.importorskip("ipykernel", reason="needs the notebook extra: pip install 'taesd_fast[notebook]'")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "examples" / "quickstart.ipynb"


def outputs_text(notebook) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_quickstart_notebook_runs_offline(monkeypatch):
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
