"""Timing a call's candidate rows on the GPU, on random stand-ins built from the call's metadata.

It runs in the tuning process (tune_worker.py) or, in blocking tuning, in the calling thread. Stand-ins are drawn
from a private generator, never from the caller's RNG."""

from __future__ import annotations

import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from .. import timing
from .spec import Spec, TensorMeta, fmt_shape
from .table import Row

REPS, WARMUP = 7, 3
PROGRESS_DELAY_S = 1.0  # the bar appears once timing a call has taken this long; TAESD_FAST_PROGRESS=0 hides it
SEED = 20240531  # the stand-ins' seed: the same metadata always gives the same stand-ins
# Set by the tuning process, whose allocator is capped: cached blocks are returned before each capture and after the
# compiles, so a capture never needs memory past the cap (freeing inside a capture would break it).
capped = False


def _fresh(meta: TensorMeta | None, gen: dict, scale: float = 1.0) -> torch.Tensor | None:
    """Random non-zero stand-in with the metadata's shape, strides, dtype and device."""
    if meta is None:
        return None
    device = torch.device(meta.device)
    if device not in gen:
        gen[device] = torch.Generator(device).manual_seed(SEED)
    t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
    return t.normal_(0.0, scale, generator=gen[device])


def _fan_in(w: TensorMeta) -> float:
    n = 1
    for d in w.shape[1:]:
        n *= d
    return n ** -0.5


def fresh_args(kind: str, meta: tuple) -> tuple:
    """A call's arguments rebuilt from `spec.args_meta`: random tensors of the same shapes, strides and dtypes,
    weights scaled like an initialised layer's (so values stay in the range real activations have)."""
    gen: dict = {}
    with torch.inference_mode(False), torch.no_grad():
        if kind == "conv2d":
            x, w, b, stride, res, relu, *folds = meta
            return (_fresh(x, gen), _fresh(w, gen, _fan_in(w)), _fresh(b, gen, 0.1), stride, _fresh(res, gen), relu,
                    *folds)
        if kind == "mem_conv":
            x, memory, w, b, frames, relu = meta
            return _fresh(x, gen), _fresh(memory, gen), _fresh(w, gen, _fan_in(w)), _fresh(b, gen, 0.1), frames, relu
        if kind == "head_full":
            x, cache, gamma, w, b, eps, patch = meta
            return (_fresh(x, gen), _fresh(cache, gen), _fresh(gamma, gen).add_(1.0), _fresh(w, gen, _fan_in(w)),
                    _fresh(b, gen, 0.1), eps, patch)
        x, w, b = meta
        return _fresh(x, gen), _fresh(w, gen, _fan_in(w)), _fresh(b, gen, 0.1)


def error_line(e: Exception, limit: int = 200) -> str:
    """An exception as one short line: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"


def _why(prefix: str, e: Exception) -> str:
    return f"{prefix}: {error_line(e, 120)}"


def _sync() -> None:
    torch.cuda.current_stream().synchronize()


def progress_bar(spec: Spec, candidates: int, show: bool) -> tqdm:
    """A bar over the candidates being compiled and timed, shown once that takes over PROGRESS_DELAY_S."""
    return tqdm(total=candidates, desc=f"taesd_fast: timing kernels for {spec.kind} {fmt_shape(spec.x_shape)} "
                "(once per GPU)", unit="candidate", leave=False, delay=PROGRESS_DELAY_S,
                disable=not show or os.environ.get("TAESD_FAST_PROGRESS", "1") == "0")


def compile_candidates(rows: list[Row], fresh: tuple, threads: int) -> None:
    """Run each kernel row once on the stand-ins from a pool of `threads` threads, so that their compiles
    (Triton's ptxas and launcher builds, NVRTC) overlap; a failure here is left for the timing loop to report."""
    kernels = [r for r in rows if r.kernel]
    if threads <= 1 or len(kernels) <= 1:
        return

    device = fresh[0].device

    def build(row: Row) -> None:
        try:
            with torch.cuda.device(device):  # a thread starts on the default device
                row.run(*fresh)
        except Exception:  # noqa: BLE001 - time_candidates runs it again and records why it fails
            pass

    with ThreadPoolExecutor(max_workers=min(threads, len(kernels)), thread_name_prefix="taesd_fast-compile") as ex:
        list(ex.map(build, kernels))
    _sync()
    if capped:
        torch.cuda.empty_cache()


def time_candidates(rows: list[Row], spec: Spec, meta: tuple, graph: bool, reps: int = REPS,
                    progress: bool = False, threads: int = 1) -> tuple[dict, dict]:
    """Median ms per call of each row on fresh random inputs; interleaved reps so clock drift hits all rows alike.
    Returns (ms, failures).

    GPU time is taken from replays of a CUDA graph of the calls (no launch gaps). graph=True returns that alone: it
    is what a replay costs. Otherwise the CPU time of launching the call eagerly is added: in a model's chain of
    layers the launch costs add up (a Triton launch costs ~0.1 ms of CPU on the H200's host), so a kernel that wins
    on the GPU but costs more to launch only pays off where the GPU saving covers its launch. The graphs share one
    memory pool (their outputs are never read), so timing holds the stand-ins and about one output, not one per
    candidate. threads > 1 compiles the candidates concurrently first."""
    fresh = fresh_args(spec.kind, meta)
    if spec.on_cuda:
        compile_candidates(rows, fresh, threads)
    pool = torch.cuda.graph_pool_handle()
    ok, failed, iters, replay = [], {}, {}, {}
    with progress_bar(spec, len(rows), progress) as bar:
        for row in rows:
            bar.set_postfix_str(row.name, refresh=False)
            run = row.run
            try:
                for _ in range(WARMUP):
                    run(*fresh)  # the first run compiles the kernel: the slow part of a first use
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(*fresh)
                end.record()
                end.synchronize()
                # Calls per rep so each rep is ~1 ms of work: one event pair's resolution does not dominate.
                iters[row.name] = max(1, min(50, int(1.0 / max(start.elapsed_time(end), 1e-3))))
            except Exception as e:  # noqa: BLE001 - a kernel that cannot build or launch here is no candidate
                failed[row.name] = _why("failed", e)
            else:
                try:
                    if capped:
                        torch.cuda.empty_cache()
                    replay[row.name] = timing.capture_calls(lambda run=run: run(*fresh), iters[row.name], pool=pool)
                    replay[row.name]()
                    _sync()
                    ok.append(row)
                except Exception as e:  # noqa: BLE001
                    failed[row.name] = _why("failed in a CUDA graph", e)
            bar.update()
    events = {r.name: [] for r in ok}
    launch_ms = {r.name: [] for r in ok}
    for _ in range(reps):
        for row in ok:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timing.busy_gpu()  # keeps the replay's submission out of the timed span
            s.record()
            replay[row.name]()
            e.record()
            events[row.name].append((s, e))
            if not graph:
                run, n = row.run, iters[row.name]
                t0 = time.perf_counter()
                for _ in range(n):
                    run(*fresh)
                launch_ms[row.name].append((time.perf_counter() - t0) * 1e3 / n)
        _sync()  # keeps the launch loops from queueing behind each other's GPU work
    ms = {}
    for name, ev in events.items():
        ms[name] = statistics.median(s.elapsed_time(e) / iters[name] for s, e in ev)
        if not graph:
            ms[name] += statistics.median(launch_ms[name])
    return ms, failed


def output_bytes(spec: Spec) -> int:
    """The bytes of one call's output (for the heads an upper bound: C_out channels over the input's frames and
    pixels, plus head_full's new cache window)."""
    x, w = spec.x_shape, spec.w_shape
    if spec.kind == "conv2d":
        h, wd = (-(-x[2] * spec.upsample // spec.stride), -(-x[3] * spec.upsample // spec.stride))
        return _nbytes((x[0], w[0], h, wd), spec.dtype)
    return _nbytes(x, spec.dtype) * w[0] // x[1] + (_nbytes(x, spec.dtype) if spec.kind == "head_full" else 0)


def bytes_needed(spec: Spec, meta: tuple) -> int:
    """GPU memory that timing this call takes, roughly: the stand-ins, plus three outputs (the graph pool's, an
    eager call's and one in flight), plus 64 MiB for workspaces. Each extra compile thread adds one output."""
    inputs = sum(_nbytes(m.shape, m.dtype) for m in meta if isinstance(m, TensorMeta))
    return inputs + 3 * output_bytes(spec) + (64 << 20)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
