"""Variants of a kernel module for the probes (head_wgmma_probe.py, conv_probe.py): the module's source with edits
applied, written beside it as taesd_fast/kernels/_probe_*.py (git-ignored) and imported, so its relative imports
and Triton's source-based compilation work as for the original. Also the Wan head chunk the head probes time."""

from __future__ import annotations

import importlib
import pathlib
from types import SimpleNamespace


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


def wan_head_chunk(t: int = 4, b: int = 1, c: int = 256, h: int = 352, w: int = 640) -> SimpleNamespace:
    """Random inputs of the head's g kernels at the Wan chunk size (T feature frames + 2 cached), packed as the
    kernels take them, and their outputs allocated: feat, cache, gamma, wt, gs, g, nc."""
    import torch
    import torch.nn.functional as F

    from taesd_fast.kernels import head_fused as hf

    torch.manual_seed(0)
    feat = torch.randn(b, c, t, h, w, device="cuda").bfloat16()
    cache = F.silu(torch.randn(b, c, 2, h, w, device="cuda")).bfloat16()
    gamma = (1 + 0.1 * torch.randn(c, 1, 1, 1, device="cuda")).bfloat16()
    weight = (torch.randn(12, c, 3, 3, 3, device="cuda") * (0.6 / (27 * c) ** 0.5)).bfloat16()
    return SimpleNamespace(feat=feat, cache=cache, gamma=gamma, wt=hf.pack_weight_taps_t(weight),
                           gs=hf.scaled_gamma(gamma, c**0.5), g=feat.new_empty((b, t, h, w, hf.GC)),
                           nc=feat.new_empty((b, c, 2, h, w)))
