"""Variants of a kernel module for the probes (head_wgmma_probe.py, conv_probe.py): the module's source with edits
applied, written beside it as taesd_fast/kernels/_probe_*.py (git-ignored) and imported, so its relative imports
and Triton's source-based compilation work as for the original."""

from __future__ import annotations

import importlib
import pathlib


def load_variant(module, name: str, edits):
    """module's source with edits applied, imported as a new module. edits: (old, new) string pairs, each of which
    must occur, or (compiled regex, replacement) pairs, each of which must match."""
    path = pathlib.Path(module.__file__)
    src = path.read_text()
    for old, new in edits:
        if isinstance(old, str):
            assert old in src, (name, old[:70])
            src = src.replace(old, new)
        else:
            src, count = old.subn(new, src)
            assert count, (name, old.pattern)
    tag = "".join(ch if ch.isalnum() else "_" for ch in f"{module.__name__.rsplit('.', 1)[-1]}_{name}")
    (path.parent / f"_probe_{tag}.py").write_text(src)
    return importlib.import_module(f"{module.__package__}._probe_{tag}")
