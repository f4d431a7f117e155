"""A fake row set for the tuning tests on CPU, installed in the test process and, through TAESD_FAST_TUNER_SETUP=
tuning_fakes:install, in the tuning process: the conv2d table becomes PyTorch plus a "fake" kernel row that runs on
CPU tensors (a float64 conv, so a test can tell which row ran), and timing is replaced by a deterministic stand-in
(the fake row is twice as fast as PyTorch). Environment variables steer the stand-in in the tuning process:

    FAKE_TUNING_SLEEP   seconds each timing takes
    FAKE_TUNING_FAIL    raise RuntimeError("kernel build exploded")
    FAKE_TUNING_CRASH   exit the process with this code inside the timing
    FAKE_TUNING_LOG     append "x_shape graph pid" per timing to this file
    FAKE_TUNING_ROW_OOM the fake row fails with an out-of-memory error (PyTorch is timed)
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

CALLS: list = []  # input shapes the fake kernel ran on, in this process


def fake_conv(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False):
    CALLS.append(tuple(x.shape))
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=stride, padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual.double()
    return (torch.relu(y) if relu else y).to(x.dtype)


def fake_time_candidates(rows, spec, meta, graph, reps=7, progress=False, threads=1):
    log = os.environ.get("FAKE_TUNING_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{'x'.join(map(str, spec.x_shape))} {int(graph)} {os.getpid()}\n")
    time.sleep(float(os.environ.get("FAKE_TUNING_SLEEP", 0)))
    if os.environ.get("FAKE_TUNING_CRASH"):
        os._exit(int(os.environ["FAKE_TUNING_CRASH"]))
    if os.environ.get("FAKE_TUNING_FAIL"):
        raise RuntimeError("kernel build exploded")
    if os.environ.get("FAKE_TUNING_ROW_OOM"):
        return {"torch": 1.0}, {r.name: "failed: OutOfMemoryError: CUDA out of memory" for r in rows if r.kernel}
    return {r.name: (1.0 if r.name == "torch" else 0.5) for r in rows}, {}


def rows():
    from taesd_fast.dispatch import table

    return [table.row("conv2d", "torch"),
            table.Row("fake", "conv2d", fake_conv, supports=three_by_three, devices=("cpu",), nvrtc=False,
                      layouts=("nchw",))]


def three_by_three(spec) -> str | None:
    """The fake row's rule: 3x3 convs only."""
    return None if spec.w_shape[2:] == (3, 3) else f"{spec.w_shape[2]}x{spec.w_shape[3]} kernel (3x3 only)"


def install() -> None:
    from taesd_fast.dispatch import measure, table

    table.ROWS[:] = rows() + [r for r in table.ROWS if r.kind != "conv2d"]
    measure.time_candidates = fake_time_candidates
