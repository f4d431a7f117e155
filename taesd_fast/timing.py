"""GPU timing shared by the benchmark sections: CUDA events, warm-up, median, optional CUDA-graph replay."""

from __future__ import annotations

import statistics

import torch

from .graphs import capture


def busy_gpu(us: float = 100.0) -> None:
    """Keep the GPU spinning for ~us before a start event is recorded. After a synchronize the GPU is idle, so the
    start event would fire at once and the timed span would include the CPU's submission of the work (a graph
    launch: tens of us, and more when the host stalls), which inflates small kernels' times."""
    spin = getattr(torch.cuda, "_sleep", None)  # a private PyTorch helper: without it, time as before
    if spin is not None:
        spin(int(us * 2000))  # ~2 GHz clock cycles; the spin length need not be exact


def time_ms(fn, reps: int = 15, target_ms: float = 4.0) -> float:
    """Median ms per call of fn(). Each rep runs enough back-to-back calls to last ~target_ms, so one
    event pair's resolution and launch jitter do not dominate small kernels."""
    fn()  # warm-up: module loads, cuDNN/autotune choices, allocator growth
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iters = max(1, min(100, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        busy_gpu()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def graphed(fn):
    """fn() captured in a CUDA graph; returns its replay (see taesd_fast.graphs.capture)."""
    return capture(fn)[0]


def chain_us(launch, n: int) -> float:
    """Microseconds per call of launch(i), i = 0..n-1, captured back to back in one CUDA graph: what a kernel costs
    inside a chain of dependent launches, as each layer of a replayed B=1 decode does (a single-kernel replay would
    add the replay's own start-up to every number)."""

    def chain():
        for i in range(n):
            launch(i)

    return time_ms(graphed(chain)) * 1e3 / n
