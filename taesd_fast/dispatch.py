"""Which implementation runs each conv: one table of candidates, chosen per shape by measurement.

Modes (`backend(mode)` / `set_backend(mode)`):
  "auto"    (default) a custom kernel runs only where it was measured faster than PyTorch/cuDNN on
            this GPU for this exact (shape, dtype, stride, epilogue, layout), counting GPU time plus the
            CPU time of an eager launch (see `measure`); timings persist as JSON
            in the cache dir and are reused. No timing while torch.compile traces or a CUDA graph
            captures: then the cached decision, else PyTorch. Inside `graph_timing()` (entered by
            `graphs.capture` and `CUDAGraphed`) candidates are timed as CUDA-graph replays instead,
            and those decisions are kept apart from the eager ones.
  "kernels" the fastest measured custom kernel wherever one supports the call (default order
            `_DEFAULT_ORDER` when none was measured), else PyTorch. Used by tests.
  "torch"   always PyTorch.
Importing this module touches no CUDA.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from . import _backend
from .kernels import head as _split_head  # registers taesd_fast::conv_n128 / head_stencil; no CUDA

__all__ = [
    "conv2d", "head_conv", "backend", "set_backend", "get_backend", "dispatch_table", "tune",
    "Candidate", "Spec", "CANDIDATES", "clear_cache", "graph_timing",
]

_MODES = ("auto", "torch", "kernels")
_mode = "auto"
_TIMING_METHOD = 2  # in the timings-file key: 2 = graph-replay GPU time (+ eager launch CPU time); 1 = eager events
_MARGIN = 0.98  # a kernel must beat PyTorch by 2% to be picked: timing noise must not flip choices
_REPS, _WARMUP = 7, 3
# Timing a shape for the first time on a GPU compiles every candidate: seconds (run HH3, H200: a cold first decode
# 10.7 s). A progress bar says so when it takes longer than this; TAESD_FAST_PROGRESS=0 hides it.
_PROGRESS_DELAY_S = 1.0


# ------------------------------------------------------------------------------------ spec


@dataclass(frozen=True)
class Spec:
    """Everything a decision depends on; hashable, shapes as plain ints."""

    kind: str  # "conv2d" | "head" | "head_full"
    device: str  # "cpu", "cuda:0", ...
    x_shape: tuple
    w_shape: tuple
    dtype: torch.dtype
    stride: int
    bias: bool
    residual: bool
    relu: bool
    layout: str  # "nchw" | "channels_last" | "strided"
    upsample: int = 1  # conv2d: nearest upsample of x by this factor before the conv (kernels fold it)
    pre_clamp: bool = False  # conv2d: soft clamp 3*tanh(x/3) of x before the conv (the decoder's Clamp)
    patch: int = 0  # head_full: unpatchify the output by this factor (0: none; kernels write the video directly)

    def key(self, gpu: str, graph: bool = False) -> str:
        """Timings-file key; `graph` marks timings taken as CUDA-graph replays."""
        shp = lambda s: "x".join(map(str, s))  # noqa: E731
        flags = "".join(f for f, on in (("b", self.bias), ("r", self.residual), ("R", self.relu)) if on) or "-"
        return (f"{gpu}|torch{torch.__version__}|src{_backend.sources_hash()}|t{_TIMING_METHOD}|{self.kind}|"
                f"x{shp(self.x_shape)}|w{shp(self.w_shape)}|"
                f"{str(self.dtype).replace('torch.', '')}|s{self.stride}|{flags}|{self.layout}"
                + (f"|u{self.upsample}" if self.upsample != 1 else "") + ("|clamp" if self.pre_clamp else "")
                + (f"|p{self.patch}" if self.patch else "") + ("|graph" if graph else ""))


def _layout(x: Tensor) -> str:
    if x.is_contiguous():
        return "nchw"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last"
    return "strided"


# ------------------------------------------------------------------------------------ candidates


@dataclass(frozen=True)
class Candidate:
    """One implementation of a call `kind`. `supports(spec)` returns None or why not; `run` takes the
    kind's arguments: conv2d (x, w, b, stride, residual, relu, upsample, pre_clamp), head (x, w, b), head_full
    (x, cache, gamma, w, b, eps, patch) returning (out, new cache). `kernel=True` marks
    custom kernels (they also need kernels_available and are what auto mode must justify by timing).
    `ready(spec)` says it can launch without compiling/loading (checked during CUDA-graph capture)."""

    name: str
    kind: str
    supports: Callable[[Spec], str | None]
    run: Callable[..., Tensor]
    kernel: bool = True
    ready: Callable[[Spec], bool] = lambda spec: True
    layouts: tuple = ("nchw",)  # input layouts the kernel reads natively (others are converted first)
    nvrtc: bool = True  # needs our NVRTC-built kernels (Triton candidates check Triton in `supports` instead)


def soft_clamp(x: Tensor) -> Tensor:
    """TAESD's latent clamp to (-3, 3), as upstream writes it (so the PyTorch path stays bit-identical)."""
    return torch.tanh(x / 3) * 3


def _torch_conv2d(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False):
    if pre_clamp:
        x = soft_clamp(x)
    if upsample != 1:
        x = F.interpolate(x, scale_factor=upsample, mode="nearest")
    y = F.conv2d(x, w, b, stride=stride, padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if relu else y


def _torch_head(x, w, b):
    return F.conv3d(x, w, b, padding=(0, 1, 1)).clamp(-1.0, 1.0)


def _torch_head_full(x, cache, gamma, w, b, eps, patch=0):
    window = _split_head.causal_window(_split_head.activate(x, gamma, eps), cache)
    return _split_head.unpatchify(_torch_head(window, w, b), patch), window[:, :, -2:]


def _split_head_full(x, cache, gamma, w, b, eps, patch=0):
    window = _split_head.causal_window(_split_head.activate(x, gamma, eps), cache)
    return _split_head.split_head_conv(window, w, b, patch=patch), window[:, :, -2:]


def _head_full_window_spec(s: Spec) -> Spec:
    """The split conv's spec inside a head_full call: the window has 2 more frames than the features (the patch
    selects the stencil kernel that writes the video)."""
    b, c, t, h, w = s.x_shape
    return Spec("head", s.device, (b, c, t + 2, h, w), s.w_shape, s.dtype, 1, s.bias, False, False, s.layout,
                patch=s.patch)


def _f16_candidate(variant: str) -> Candidate:
    from .kernels import conv3x3 as k  # registers the op; touches no CUDA

    def supports(s: Spec) -> str | None:
        if not s.device.startswith("cuda"):
            return "CPU tensor"
        if s.upsample != 1 or s.pre_clamp:
            return "no upsample or clamp fold in the SIMT kernels"
        return k.unsupported_reason(s.x_shape, s.w_shape, s.dtype, s.stride, variant)

    def run(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False):
        return torch.ops.taesd_fast.conv3x3_f16(x, w, b, residual, stride, relu, variant)

    def ready(s: Spec) -> bool:
        defines = k.kernel_defines(s.w_shape[1], s.w_shape[0], s.stride, variant)
        return _backend.is_loaded(k._SOURCE, f"conv3x3_{variant}", defines, s.device)

    return Candidate(f"f16_{variant}", "conv2d", supports, run, True, ready)


def _cpu_reason(s: Spec) -> str | None:
    """Checked before a Triton candidate's module is imported: importing Triton takes a second, for nothing on CPU."""
    return None if s.device.startswith("cuda") else "CPU tensor"


def _tc_candidate() -> Candidate:
    """The Triton tensor-core conv (kernels/conv_tc.py), imported on first use: importing Triton is slow.
    Calls that a CUDA graph will replay take its TMA and row-streaming kernels (faster on the GPU, and each launch
    builds TMA descriptors on the host); eager calls the pointer kernel,
    whose launch costs less CPU time (H200 host: 95 vs 107 us; eager encode 256² B=16 took 5.6 ms with TMA
    launches, 2.9 ms without, BENCHMARKS.md)."""

    def tc():
        from .kernels import conv_tc

        return conv_tc

    return Candidate("tc", "conv2d", lambda s: _cpu_reason(s) or tc().spec_unsupported_reason(s),
                     lambda *a: tc().run_conv2d(*a, tma=_graph_timing),
                     True, lambda s: tc().spec_ready(s, tma=_graph_timing), ("channels_last",), nvrtc=False)


def _fused_head_candidate() -> Candidate:
    """The fused head (kernels/head_fused.py: norm + SiLU + temporal GEMM in one kernel, the Gluon wgmma one on
    sm_90 (head_wgmma.py) or a Triton one elsewhere, then our NVRTC stencil), imported on first use. Reads NCDHW
    features and chunk slices of them in place."""

    def fh():
        from .kernels import head_fused

        return head_fused

    return Candidate("triton_fused", "head_full", lambda s: _cpu_reason(s) or fh().spec_unsupported_reason(s),
                     lambda *a: fh().head_full_triton(*a), True, lambda s: fh().spec_ready(s), ("nchw", "strided"))


def _norm_split_candidate() -> Candidate:
    """Triton norm + SiLU into the causal window (kernels/head_act.py), then split_head_conv."""

    def ha():
        from .kernels import head_act

        return head_act

    def supports(s: Spec) -> str | None:
        return (_cpu_reason(s) or ha().unsupported_reason(s.x_shape, s.dtype, s.device.split(":")[0])
                or _split_head.spec_unsupported_reason(_head_full_window_spec(s)))

    return Candidate("triton_norm_split", "head_full", supports, lambda *a: ha().head_full_norm_split(*a), True,
                     lambda s: _split_head.spec_ready(_head_full_window_spec(s)), ("nchw", "strided"))


_always = lambda s: None  # noqa: E731
CANDIDATES: list[Candidate] = [
    Candidate("torch", "conv2d", _always, _torch_conv2d, kernel=False),
    _tc_candidate(),
    _f16_candidate("rb"),
    _f16_candidate("ocb4"),
    _f16_candidate("tile"),
    Candidate("torch", "head", _always, _torch_head, kernel=False),
    Candidate("split_bf16", "head", _split_head.spec_unsupported_reason, _split_head.split_head_conv, True,
              _split_head.spec_ready, ("nchw", "channels_last")),
    # head_full: RMS norm + SiLU + causal window + conv + clamp in one call; returns (out, new cache).
    Candidate("torch", "head_full", _always, _torch_head_full, kernel=False),
    _fused_head_candidate(),
    _norm_split_candidate(),
    Candidate("split_bf16", "head_full", lambda s: _split_head.spec_unsupported_reason(_head_full_window_spec(s)),
              _split_head_full, True, lambda s: _split_head.spec_ready(_head_full_window_spec(s)),
              ("nchw", "channels_last")),
]
# Forced-kernel mode with no timings: the order measured best on H200 (tensor-core conv, then the SIMT convs),
# then the head kernels.
_DEFAULT_ORDER = ("tc", "f16_rb", "f16_ocb4", "f16_tile", "triton_fused", "triton_norm_split", "split_bf16")


_RUN: dict[tuple, Callable[..., Tensor]] = {(c.kind, c.name): c.run for c in CANDIDATES}


def _by_name(kind: str, name: str) -> Candidate:
    for c in CANDIDATES:
        if c.kind == kind and c.name == name:
            return c
    raise KeyError(f"no {kind} candidate named {name!r}")


# ------------------------------------------------------------------------------------ mode


def set_backend(mode: str) -> None:
    global _mode
    if mode not in _MODES:
        raise ValueError(f"backend mode must be one of {_MODES}, got {mode!r}")
    _mode = mode


def get_backend() -> str:
    return _mode


_graph_timing = False  # see graph_timing(); process-global like the mode


@contextlib.contextmanager
def graph_timing():
    """Decide for calls that a CUDA graph will replay: candidates are timed as graph replays, so a launch's CPU
    cost (a Triton launch: ~0.1 ms on the H200's host) counts for nothing, as in the replay. Eager timing charges
    it and keeps cuDNN on small layers where our kernels are faster on the GPU. Eager calls outside this context
    keep their own decisions."""
    global _graph_timing
    prev = _graph_timing
    _graph_timing = True
    try:
        yield
    finally:
        _graph_timing = prev


@contextlib.contextmanager
def backend(mode: str):
    """with backend("torch"|"kernels"|"auto"): ... restores the previous mode on exit."""
    prev = _mode
    set_backend(mode)
    try:
        yield
    finally:
        set_backend(prev)


# ------------------------------------------------------------------------------------ timing cache

_lock = threading.RLock()
_decided: dict[tuple, "Record"] = {}  # (mode, graph timing, key tuple) -> decision; the per-call fast path
_timings: dict[str, dict] | None = None  # Spec.key -> {"ms": {name: ms}, ...}; disk-backed
_gpu_names: dict[str, str] = {}
_records: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, Record]]" = weakref.WeakKeyDictionary()


@dataclass
class Record:
    spec: Spec
    choice: str
    why: str
    ms: dict  # candidate name -> median ms (timed candidates only)
    skipped: dict  # candidate name -> reason it was not eligible


def _timings_path():
    return _backend.cache_dir() / "dispatch" / "timings.json"


def _read_json(path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _file_lock(path):
    try:
        from filelock import FileLock
    except ImportError:  # filelock comes with huggingface_hub; without it fall back to flock
        import fcntl

        with open(str(path) + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    with FileLock(str(path) + ".lock", timeout=60):
        yield


def store_timings(entries: dict, path=None) -> dict:
    """Merge `entries` into the JSON file under a lock (re-read, update, atomic replace); returns the
    merged content. Safe with several processes writing at once."""
    path = _timings_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        data = _read_json(path)
        data.update(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return data


def _cached(key: str) -> dict | None:
    global _timings
    if _timings is None:
        _timings = _read_json(_timings_path())
    return _timings.get(key)


def _remember(key: str, persisted: dict, entry: dict) -> None:
    global _timings
    try:
        _timings = store_timings({key: persisted})
    except OSError:  # read-only cache dir: keep the result for this process only
        _timings = dict(_timings or {})
    _timings[key] = entry


def clear_cache(disk: bool = False) -> None:
    """Forget in-process decisions and records (and the timings file if disk=True)."""
    global _timings
    with _lock:
        _decided.clear()
        _records.clear()
        _timings = None
        if disk:
            with contextlib.suppress(OSError):
                _timings_path().unlink()


def _gpu_name(device: str) -> str:
    if device not in _gpu_names:
        _gpu_names[device] = torch.cuda.get_device_name(torch.device(device)).replace("|", "/")
    return _gpu_names[device]


def _fresh_like(t: Tensor | None, scale: float = 1.0) -> Tensor | None:
    """Random non-zero stand-in with the same shape, dtype, device and strides."""
    if t is None:
        return None
    r = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return r.normal_(0.0, scale)


def _fresh_args(kind: str, args: tuple) -> tuple:
    if kind == "conv2d":
        x, w, b, stride, res, relu, *folds = args
        fan_in = w[0].numel()
        return (_fresh_like(x), _fresh_like(w, fan_in**-0.5), _fresh_like(b, 0.1), stride, _fresh_like(res), relu,
                *folds)
    if kind == "head_full":
        x, cache, gamma, w, b, eps, patch = args
        return (_fresh_like(x), _fresh_like(cache), _fresh_like(gamma).add_(1.0), _fresh_like(w, w[0].numel() ** -0.5),
                _fresh_like(b, 0.1), eps, patch)
    x, w, b = args
    return (_fresh_like(x), _fresh_like(w, w[0].numel() ** -0.5), _fresh_like(b, 0.1))


def _graphed_calls(fn: Callable[[], object], n: int) -> Callable[[], None]:
    """n calls of fn captured in one CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return graph.replay


def measure(cands: list[Candidate], kind: str, args: tuple, reps: int = _REPS, graph: bool = False) -> tuple[dict, dict]:
    """Median ms per call for each candidate on fresh random inputs; interleaved reps so clock drift hits all
    candidates alike. Returns (ms, failures).

    GPU time is taken from replays of a CUDA graph of the calls (no launch gaps). graph=True returns that alone: it
    is what a replay costs. Otherwise the CPU time of launching the call eagerly is added: in a model's chain of
    layers the CPU launch costs add up (a Triton launch costs ~0.1 ms of CPU on the H200's host), so a kernel
    that wins on the GPU but costs more to launch only pays off where the GPU saving covers its launch."""
    with _tuning_bar(kind, args, len(cands)) as bar:
        return _measure(cands, kind, args, reps, graph, bar)


def _tuning_bar(kind: str, args: tuple, candidates: int) -> tqdm:
    """A progress bar over the candidates being compiled and timed, shown once that takes over _PROGRESS_DELAY_S."""
    shape = "x".join(map(str, args[0].shape))
    return tqdm(total=candidates, desc=f"taesd_fast: timing kernels for {kind} {shape} (once per GPU)",
                unit="candidate", leave=False, delay=_PROGRESS_DELAY_S,
                disable=os.environ.get("TAESD_FAST_PROGRESS", "1") == "0")


def _measure(cands: list[Candidate], kind: str, args: tuple, reps: int, graph: bool, bar: tqdm) -> tuple[dict, dict]:
    with torch.inference_mode(False):  # stand-ins must be ordinary tensors even under inference_mode
        fresh = _fresh_args(kind, args)
    ok, failed = [], {}
    for c in cands:
        bar.set_postfix_str(c.name, refresh=False)
        try:
            for _ in range(_WARMUP):
                c.run(*fresh)  # the first run compiles the kernel: the slow part of a first use
            torch.cuda.synchronize()
            ok.append(c)
        except Exception as e:  # a kernel that cannot build/launch here is simply not a candidate
            failed[c.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        bar.update()
    # Calls per rep so each rep is ~1 ms of work: one event pair's resolution does not dominate.
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters, replay = {}, {}
    for c in list(ok):
        e0.record()
        c.run(*fresh)
        e1.record()
        e1.synchronize()
        iters[c.name] = max(1, min(50, int(1.0 / max(e0.elapsed_time(e1), 1e-3))))
        try:
            replay[c.name] = _graphed_calls(lambda c=c: c.run(*fresh), iters[c.name])
            replay[c.name]()
        except Exception as e:
            ok.remove(c)
            failed[c.name] = f"failed in a CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch.cuda.synchronize()
    from .timing import busy_gpu  # (timing imports graphs, which imports this module)

    events = {c.name: [] for c in ok}
    launch_ms = {c.name: [] for c in ok}
    for _ in range(reps):
        for c in ok:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            busy_gpu()  # keeps the replay's submission out of the span (suspected of 18 us timings of 4 us kernels)
            s.record()
            replay[c.name]()
            e.record()
            events[c.name].append((s, e))
            if not graph:
                t0 = time.perf_counter()
                for _ in range(iters[c.name]):
                    c.run(*fresh)
                launch_ms[c.name].append((time.perf_counter() - t0) * 1e3 / iters[c.name])
        torch.cuda.synchronize()  # keeps the launch loops from queueing behind each other's GPU work
    ms = {}
    for n, ev in events.items():
        ms[n] = statistics.median(s.elapsed_time(e) / iters[n] for s, e in ev)
        if not graph:
            ms[n] += statistics.median(launch_ms[n])
    return ms, failed


# ------------------------------------------------------------------------------------ decision


def _kernel_reason(device: str) -> str | None:
    if torch.cuda.is_current_stream_capturing() and not _backend.probed(device):
        return "kernels not probed before CUDA-graph capture (probing compiles and loads a module)"
    return _backend.kernels_unavailable_reason(device)


def _eligible(spec: Spec) -> tuple[list[Candidate], dict]:
    """Candidates of spec.kind that support it (custom kernels also need kernels_available)."""
    out, skipped = [], {}
    kernel_reason = None
    for c in CANDIDATES:
        if c.kind != spec.kind:
            continue
        why = c.supports(spec)
        if why is None and c.kernel and c.nvrtc:
            if kernel_reason is None:
                kernel_reason = _kernel_reason(spec.device) or ""
            why = kernel_reason or None
        elif why is None and c.kernel and _backend._disabled():  # the switch covers the Triton kernels too
            why = "disabled by TAESD_FAST_DISABLE_KERNELS"
        if why is None:
            out.append(c)
        else:
            skipped[c.name] = why
    return out, skipped


def _decide(spec: Spec, mode: str, args: tuple) -> Record:
    """Full (slow-path) decision for one spec in eager mode; may time candidates."""
    cands, skipped = _eligible(spec)
    if mode == "auto":
        # A kernel that converts the layout on the way in hands the next layer a different layout too; timing
        # it alone would hide that cost (seen on the H200: TAESD encode 12% slower), so auto leaves it out.
        for c in [c for c in cands if c.kernel and spec.layout not in c.layouts]:
            cands.remove(c)
            skipped[c.name] = f"input is {spec.layout}; kernel reads {'/'.join(c.layouts)} natively"
    kernels = [c for c in cands if c.kernel]
    ref = next(c for c in cands if not c.kernel)
    if mode == "torch" or not kernels:
        first = next(iter(skipped.items()), None)
        why = "forced torch" if mode == "torch" else "no custom kernel for this call" + (f" ({first[0]}: {first[1]})" if first else "")
        return Record(spec, ref.name, why, {}, skipped)
    graph = _graph_timing
    key = spec.key(_gpu_name(spec.device), graph)
    entry = _cached(key)
    if mode == "kernels":  # tests force kernels on many shapes: use timings if any, never time
        return _static_record(spec, mode, cands, skipped, entry, "no timings")
    timed = [c.name for c in cands]
    if entry is None or any(n not in entry["ms"] and n not in entry.get("failed", {}) for n in timed):
        if not _can_time():
            return _static_record(spec, mode, cands, skipped, entry, "not timed (compiling/capturing)")
        ms, failed = measure(cands, spec.kind, args, graph=graph)
        entry = {"ms": ms, "failed": failed}
        # Failures (an OOM while timing, a compile error) stay in this process; only timings persist.
        _remember(key, {"ms": ms}, entry)
        why = "measured"
    else:
        why = "cached timings"
    if graph:
        why += " (graph replays)"
    return _pick(spec, mode, cands, skipped, entry, why)


def _pick(spec, mode, cands, skipped, entry, why) -> Record:
    ms = {n: t for n, t in entry["ms"].items() if any(c.name == n for c in cands)}
    skipped = dict(skipped, **entry.get("failed", {}))
    ref = next(c.name for c in cands if not c.kernel)
    kern = {n: t for n, t in ms.items() if n != ref and n not in entry.get("failed", {})}
    if mode == "kernels":
        if kern:
            return Record(spec, min(kern, key=kern.get), f"forced kernels, {why}", ms, skipped)
        return Record(spec, ref, "forced kernels, but every kernel failed", ms, skipped)
    best = min(kern, key=kern.get) if kern else None
    if best is not None and ref in ms and kern[best] < _MARGIN * ms[ref]:
        return Record(spec, best, why, ms, skipped)
    return Record(spec, ref, why, ms, skipped)


def _static_record(spec, mode, cands, skipped, entry, why) -> Record:
    """Decision without timing: cached timings if any, else the default kernel order (forced mode) or
    PyTorch (auto). Used while compiling / capturing."""
    if entry is not None and entry.get("ms"):
        return _pick(spec, mode, cands, skipped, entry, why)
    names = [c.name for c in cands]
    if mode == "kernels":
        for n in _DEFAULT_ORDER:
            if n in names:
                return Record(spec, n, f"forced kernels, default order ({why})", {}, skipped)
    return Record(spec, next(c.name for c in cands if not c.kernel), why, {}, skipped)


def _can_time() -> bool:
    return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()


def _choose(key: tuple, args: tuple, layer) -> Callable[..., Tensor]:
    """Run function for this call. The fast path is one dict lookup on plain tuples, so torch.compile
    traces it (guarding on the dicts) and bakes in the decision made eagerly for this shape."""
    mode = _mode
    rec = _decided.get((mode, _graph_timing, key))
    if torch.compiler.is_compiling():
        # Never time or compile while tracing; nothing decided eagerly for this shape means PyTorch.
        return _RUN[(key[0], "torch" if rec is None else rec.choice)]
    if rec is None:
        rec = _decide_eager(key, mode, args)
    if layer is not None:  # every layer gets its row, also when another layer with this shape decided first
        recs = _records.get(layer)
        if recs is None or recs.get(key) is not rec:
            _records.setdefault(layer, {})[key] = rec
    return _RUN[(key[0], rec.choice)]


def _decide_eager(key: tuple, mode: str, args: tuple) -> "Record":
    spec = _spec(key)
    with _lock:
        rec = _decide(spec, mode, args)
        if rec.choice != "torch" and torch.cuda.is_current_stream_capturing():
            if not _by_name(spec.kind, rec.choice).ready(spec):  # loading a module mid-capture is unsafe
                rec = Record(spec, "torch", f"{rec.why}; kernel not loaded before capture", rec.ms, rec.skipped)
        if not (spec.device.startswith("cuda") and torch.cuda.is_current_stream_capturing()):
            # a capture-time fallback must not stick: the next eager call decides properly
            _decided[(mode, _graph_timing, key)] = rec
        return rec


def _key(kind, x, w, b, stride, residual, relu, upsample=1, pre_clamp=False, patch=0) -> tuple:
    """Spec's fields as a plain tuple (same order), built on every call: the device and the shapes stay torch
    objects (hashing a torch.Size equals hashing the tuple); `_spec` converts them on the slow path."""
    return (kind, x.device, x.shape, w.shape, x.dtype, stride, b is not None, residual is not None, relu, _layout(x),
            upsample, pre_clamp, patch)


def _spec(key: tuple) -> Spec:
    kind, device, x_shape, w_shape, dtype, stride, bias, residual, relu, layout, upsample, pre_clamp, patch = key
    return Spec(kind, str(device), tuple(x_shape), tuple(w_shape), dtype, int(stride), bias, residual, bool(relu),
                layout, int(upsample), bool(pre_clamp), int(patch))


# ------------------------------------------------------------------------------------ contract


def _needs_grad(*tensors) -> bool:
    """Our ops define no backward: a call that autograd must differentiate runs PyTorch."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, stride: int = 1,
           residual: Tensor | None = None, relu: bool = False, upsample: int = 1, pre_clamp: bool = False,
           layer: nn.Module | None = None) -> Tensor:
    """y = conv2d(up(c(x)), weight, bias, stride, padding=k//2) (+ residual); relu(y) if relu, where up is a
    nearest upsample by `upsample` (1: none) and c is `soft_clamp` if pre_clamp; kernels may fold both into the conv.
    x: [B, C_in, H, W]; weight: [C_out, C_in, k, k]; residual: [B, C_out, Ho, Wo]."""
    args = (x, weight, bias, stride, residual, relu, upsample, pre_clamp)
    if _mode == "torch" or _needs_grad(x, weight, bias, residual):
        return _torch_conv2d(*args)
    return _choose(_key("conv2d", *args), args, layer)(*args)


def head_conv(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: nn.Module | None = None) -> Tensor:
    """clamp(conv3d(x, weight, bias, padding=(0, 1, 1)), -1, 1).
    x: [B, C_in, T+2, H, W] (causal frames in front); weight: [C_out, C_in, 3, 3, 3] -> [B, C_out, T, H, W]."""
    args = (x, weight, bias)
    if _mode == "torch" or _needs_grad(x, weight, bias):
        return _torch_head(*args)
    return _choose(_key("head", x, weight, bias, 1, None, False), args, layer)(*args)


def head_full(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
              patch: int = 0, *, layer: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """The whole output head: window = [cache | silu(rms_norm(x))] (zero frames when cache is None), then
    (unpatchify(clamp(conv3d(window, weight, bias, padding=(0, 1, 1)), -1, 1), patch), window[:, :, -2:]).
    x: [B, C_in, T, H, W]; cache: [B, C_in, 2, H, W] post-SiLU frames or None; patch 0: no unpatchify."""
    args = (x, cache, gamma, weight, bias, eps, patch)
    if _mode == "torch" or _needs_grad(x, cache, gamma, weight, bias):
        return _torch_head_full(*args)
    # Spec.residual records whether a cache was given (the first chunk has none).
    return _choose(_key("head_full", x, weight, bias, 1, cache, False, patch=patch), args, layer)(*args)


# ------------------------------------------------------------------------------------ reporting


def tune(fn: Callable, *args, **kwargs):
    """Run fn(*args) once in auto mode without grad, so every conv it reaches is timed and cached
    (do this before torch.compile). For a CUDA graph you capture yourself, call tune and capture both inside
    `graph_timing()` (or use graphs.CUDAGraphed, which does). Returns fn's output."""
    with backend("auto"), torch.no_grad():
        return fn(*args, **kwargs)


def _fmt_shape(s) -> str:
    return "x".join(map(str, s))


def dispatch_table(model: nn.Module) -> str:
    """One row per (layer, shape) that went through dispatch in eager mode: choice and timings."""
    rows = []
    for name, mod in model.named_modules():
        for r in _records.get(mod, {}).values():
            spec = r.spec
            res = "cache" if spec.kind == "head_full" else "res"
            flags = "+".join(f for f, on in (("clamp", spec.pre_clamp), ("up2", spec.upsample == 2), ("bias", spec.bias),
                                             (res, spec.residual), ("relu", spec.relu),
                                             (f"unpatchify{spec.patch}", spec.patch)) if on)
            times = " ".join(f"{n}={t:.4f}" for n, t in sorted(r.ms.items(), key=lambda kv: kv[1]))
            rows.append([getattr(mod, "layer_name", name) or name, _fmt_shape(spec.x_shape), _fmt_shape(spec.w_shape),
                         str(spec.dtype).replace("torch.", ""), str(spec.stride), flags or "-", spec.layout, r.choice,
                         r.why, times or "-"])
    head = ["layer", "input", "weight", "dtype", "s", "epilogue", "layout", "choice", "why", "median ms"]
    lines = [f"dispatch mode={_mode}"]
    if not rows and _mode == "torch":
        lines.append("(mode torch: every conv runs PyTorch and no choices are recorded; use auto or kernels for rows)")
        return "\n".join(lines)
    if not rows:
        lines.append("(no convs dispatched yet: run the model once on the device, e.g. model.decode(latents) or "
                     "dispatch.tune(model.decode, latents))")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
