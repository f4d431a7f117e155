"""GPU timing: CUDA events, warm-up, median, and CUDA-graph replays. A leaf module: it knows nothing of dispatch,
so the dispatcher (which times its candidates with it) and the benchmarks can both import it."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


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


def capture_calls(fn: Callable[[], object], n: int = 1, warmup: int = 0, pool=None) -> Callable[[], None]:
    """n calls of fn() captured back to back in one CUDA graph, on the current stream's device; returns the
    graph's replay. `warmup` eager calls on a side stream first (capture needs them for anything that allocates
    or loads on first use). `pool`: a `torch.cuda.graph_pool_handle()` shared with other captures whose outputs
    are never read, so their memory is reused instead of each graph holding its own.

    The capture runs on a private stream in "thread_local" mode: only this thread is barred from unsafe calls
    (allocations, synchronizes). Unlike `torch.cuda.graph(...)` it does not synchronize the device or empty the
    allocator's cache first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            for _ in range(n):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn() captured in a CUDA graph after one warm-up call; returns its replay. For dispatched model calls use
    `taesd_fast.graphs.graphed`, which lets the dispatcher decide for graph replays."""
    return capture_calls(fn, 1, warmup=1)


def chain_us(launch, n: int) -> float:
    """Microseconds per call of launch(i), i = 0..n-1, captured back to back in one CUDA graph: what a kernel costs
    inside a chain of dependent launches, as each layer of a replayed B=1 decode does (a single-kernel replay would
    add the replay's own start-up to every number)."""

    def chain():
        for i in range(n):
            launch(i)

    return time_ms(graphed(chain)) * 1e3 / n
