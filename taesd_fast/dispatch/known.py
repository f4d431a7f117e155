"""Timings measured on known GPU models, shipped with the package, to shorten first-use tuning.

Tuning a call compiles every eligible kernel row, and compiling, not timing, is most of a first use's tuning time.
On a GPU model the package has been measured on, the rows that lost clearly there are not compiled again: for each
call the tuner times PyTorch and only the kernel rows that came within KEEP of the fastest kernel on that model
(at most MAX_ROWS), and none where PyTorch was faster than every kernel by TORCH_MARGIN. The decision is still
made from this machine's own timings; the shipped figures only choose which rows are worth timing.

A call's shipped figures are its exact entry (same shapes, dtype, epilogue, layout, graph or eager) or else the
entry of the same layer (every field but the batch and spatial size) whose N*H*W is nearest, within NEAREST of it.
With no such entry every eligible row is timed, as on an unknown GPU.

The file is `known_timings.json` beside this module: {"gpus": {gpu name: {call key: {row: ms}}}, "measured": how};
`tools/known_timings.py` builds it from a timings file. TAESD_FAST_KNOWN_TIMINGS=0 times every row;
TAESD_FAST_KNOWN_TIMINGS=PATH reads another file of the same form (a fleet's own measurements).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from .spec import Spec

KEEP = 1.25
MAX_ROWS = 2
TORCH_MARGIN = 1.25
NEAREST = 4.0
SHIPPED = Path(__file__).with_name("known_timings.json")
ENV = "TAESD_FAST_KNOWN_TIMINGS"


def call_key(spec: Spec, graph: bool) -> str:
    """The part of a timings key that names the call, without the GPU, torch and source-hash prefix."""
    return spec.key("", graph).split("|", 4)[4]


def _layer(key: str) -> tuple[str, int]:
    """(the key with the input's batch and spatial size replaced by its channel count, the input's size without its
    channels: N*H*W, or N*T*H*W for the heads)."""
    fields = key.split("|")
    n, c, *space = (int(v) for v in fields[1][1:].split("x"))
    fields[1] = f"c{c}"
    return "|".join(fields), n * math.prod(space)


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict:
    try:
        with open(path) as f:
            gpus = json.load(f)["gpus"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out = {}
    for gpu, entries in gpus.items():
        layers: dict[str, list] = {}
        for key, ms in entries.items():
            try:
                layer, size = _layer(key)
            except (ValueError, IndexError):
                continue
            layers.setdefault(layer, []).append((size, ms))
        out[gpu] = (entries, layers)
    return out


def _source() -> str | None:
    value = os.environ.get(ENV, "").strip()
    if value == "0":
        return None
    return value or str(SHIPPED)


def figures(gpu: str, spec: Spec, graph: bool) -> dict | None:
    """The shipped {row: ms} for this call on this GPU model, or None."""
    source = _source()
    if source is None or gpu not in _load(source):
        return None
    exact, layers = _load(source)[gpu]
    key = call_key(spec, graph)
    if key in exact:
        return exact[key]
    layer, size = _layer(key)
    near = [(abs(math.log(s / size)), ms) for s, ms in layers.get(layer, ()) if s > 0 and size > 0]
    if not near:
        return None
    distance, ms = min(near, key=lambda t: t[0])
    return ms if distance <= math.log(NEAREST) else None


def shortlist(gpu: str, spec: Spec, graph: bool, rows: list) -> tuple[list, dict]:
    """(the rows worth timing, {row name: why not timed}) for a call; all rows when nothing is known."""
    ms = figures(gpu, spec, graph)
    if not ms:
        return rows, {}
    kernel_ms = {r.name: ms[r.name] for r in rows if r.kernel and r.name in ms}
    if not kernel_ms:
        return rows, {}
    best = min(kernel_ms.values())
    torch_ms = next((ms[r.name] for r in rows if not r.kernel and r.name in ms), None)
    if torch_ms is not None and best >= TORCH_MARGIN * torch_ms:
        keep: set = set()
        why = f"not timed: on a {gpu} every kernel ran >= {TORCH_MARGIN}x PyTorch's time for this layer"
    else:
        keep = set(sorted(kernel_ms, key=kernel_ms.get)[:MAX_ROWS])
        keep = {n for n in keep if kernel_ms[n] <= KEEP * best}
        why = f"not timed: on a {gpu} it ran > {KEEP}x the fastest kernel's time for this layer"
    # Rows the figures do not name (new rows, or rows that failed there) are timed.
    chosen = [r for r in rows if not r.kernel or r.name in keep or r.name not in kernel_ms]
    return chosen, {r.name: why for r in rows if r not in chosen}
