"""Whole-call CUDA graphs: at small batches (live previews, B=1) launch gaps dominate, and one graph replay
removes them (on the H200, TAESD decode 256² B=1: 2.9 ms eagerly, 0.235 ms as a replay of tuned kernels).

A capture records the dispatch generation it ran under: when tuning has since changed decisions, GraphCache captures
that call again. Tuning runs in its own process, so nothing of ours issues GPU work beside a capture."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.modules.module as _module_hooks
from torch import nn

from . import dispatch


_registrations = 0  # modules and parameters registered anywhere in the process (a module tree may have changed)


def _count_registration(*_args) -> None:
    global _registrations
    _registrations += 1


_module_hooks.register_module_module_registration_hook(_count_registration)
_module_hooks.register_module_parameter_registration_hook(_count_registration)
_param_lists: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list]]" = weakref.WeakKeyDictionary()


def parameters_of(module: nn.Module) -> list:
    """list(module.parameters()), cached until any module or parameter is registered again (a new attribute,
    a replaced layer, `param = nn.Parameter(...)`). Walking a TAESD decoder's modules costs ~0.1 ms of CPU, as much
    as the GPU time of a B=1 decode replay; the cached list costs nothing. `.to()` / `.half()` keep the Parameter
    objects (they swap `.data`), so the list stays right; GraphCache's key then sees their new addresses."""
    hit = _param_lists.get(module)
    if hit is not None and hit[0] == _registrations:
        return hit[1]
    params = list(module.parameters())
    _param_lists[module] = (_registrations, params)
    return params


def capture(fn: Callable[[], torch.Tensor]):
    """Capture fn() in a CUDA graph after a side-stream warm-up (as capture requires; the warm-up also lets the
    dispatcher decide for graph replays, `dispatch.graph_timing`, and load its kernels).
    Returns (replay, output): replaying rewrites `output` in place. fn must read its inputs from the same buffers
    every call.

    The capture uses "thread_local" mode: only this thread is barred from unsafe CUDA calls while it captures, so
    another thread's eager work (a data loader copying on a side stream) does not make it fail."""
    global _capturing
    _capturing += 1
    try:
        return _capture(fn)
    finally:
        _capturing -= 1


_capturing = 0  # > 0 inside capture(): a GraphCache there runs eagerly (its caller is being captured already)


_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(purpose: str) -> torch.cuda.Stream:
    """The current device's side stream for `purpose` ("warmup": capture warm-ups; "memory": a TAEHV step's
    memory-block projections), one per device and purpose for the process: cuBLAS keeps a workspace (32 MiB on
    Hopper) per stream it has run on until the process ends, so a new stream per call would leave one behind at
    every call."""
    key = (torch.cuda.current_device(), purpose)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream()
    return stream


def _capture(fn: Callable[[], torch.Tensor]):
    with dispatch.graph_timing():
        stream = side_stream("warmup")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = fn()
    return graph.replay, output


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """fn() captured with `capture`; returns its replay. For timing a dispatched call as a CUDA-graph replay."""
    return capture(fn)[0]


class CUDAGraphed:
    """fn(x) captured once for x's shape, dtype and device; each call copies x in and replays the graph.

        preview = CUDAGraphed(taesd.decode, latents)   # captures (runs the decode a few times)
        image = preview(next_latents)                   # same shape: one graph replay

    Returns a new tensor each call (the graph's own output buffer is overwritten by the next replay).
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor):
        if not (isinstance(example, torch.Tensor) and example.is_cuda):
            raise ValueError("CUDAGraphed needs an example CUDA tensor (CUDA graphs run on the GPU only)")
        self.generation = dispatch.generation()  # read before the warm-up decides: a later change makes it stale
        self._input = example.clone()
        with torch.no_grad():
            self._replay, self._output = capture(lambda: fn(self._input))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        want = self._input
        if x.shape != want.shape or x.dtype != want.dtype or x.device != want.device:
            raise ValueError(
                f"this graph was captured for {tuple(want.shape)} {want.dtype} on {want.device}, got "
                f"{tuple(x.shape)} {x.dtype} on {x.device}; capture another CUDAGraphed for that shape"
            )
        self._input.copy_(x)
        self._replay()
        return self._output.clone()


def _replayable(x: torch.Tensor, params: list) -> bool:
    """Whether a call may run as a graph replay: CUDA, outside torch.compile and other captures, and nothing that
    autograd would have to record (a replay records no graph)."""
    if not x.is_cuda or _capturing or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))


def signature(x: torch.Tensor, params: list, *extra) -> tuple:
    """What a captured graph bakes in besides the dispatch decisions: the input's shape, dtype, device and strides,
    the dispatch mode, each parameter's address and version, and the caller's `extra` flags. A graph replays only
    for calls with the signature it was captured under (GraphCache, models/taehv/stream.py graphed_step)."""
    return (x.shape, x.dtype, x.device, x.stride(), dispatch.get_backend(), *extra,
            tuple((p.data_ptr(), p._version) for p in params))


def eager_before_capture(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An eager call of a signature that is to be replayed. In subprocess tuning it decides as the replay will
    (graph_timing): calls not timed yet run PyTorch either way, and what it sends to the tuning process are the
    specs the replays run, so tuning spends its time on those."""
    if dispatch.get_tuning() == "subprocess":
        with dispatch.graph_timing():
            return fn(x)
    return fn(x)


class CapturePolicy:
    """When a call runs as a CUDA-graph replay: the one policy of GraphCache (TAESD.encode / decode) and
    models/taehv/stream.py graphed_step (a TAEHV stream's step). Each call first picks up what the tuning process has
    answered (`dispatch.poll`), then looks up its `signature`:

    - a graph captured under the current `dispatch.generation()`: replay it;
    - a graph captured under an older generation (tuning has replaced decisions since): capture again at once;
    - a signature whose capture failed: eager, for good;
    - a signature not seen before (or a caller not `ready` to capture yet): eager (`eager_before_capture`), and
      remembered, so its next call captures;
    - else capture. A capture that fails warns once, and that signature stays eager.

    Keeps the `max_graphs` most recently used graphs and the `max_seen` signatures last called eagerly. A graph is
    what the caller's `capture()` returns: it records the generation it was captured under (`.generation`), and
    `graph(x)` copies x in, replays and returns a fresh tensor."""

    def __init__(self, max_graphs: int, max_seen: int):
        self.max_graphs = max_graphs
        self.max_seen = max_seen
        self.graphs: OrderedDict = OrderedDict()  # signature -> graph, most recently used last
        self.seen: OrderedDict = OrderedDict()  # signatures called once, oldest first
        self.failed: set = set()

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.failed.clear()

    def __len__(self) -> int:
        return len(self.graphs)

    def latest(self):
        """The most recently used graph, or None."""
        return next(reversed(self.graphs.values()), None)

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list, extra: tuple,
            capture: Callable[[], Callable[[torch.Tensor], torch.Tensor]], failure: Callable[[Exception], str],
            ready: bool = True, stacklevel: int = 1) -> torch.Tensor:
        """fn(x) eagerly or as a replay of the graph that `capture()` makes, as the policy says. `params` and
        `extra` go into the signature; `failure(err)` is the warning's text when a capture fails, and `stacklevel`
        what run's caller would pass to warnings.warn for it."""
        dispatch.poll()
        key = signature(x, params, *extra)
        graph = self.graphs.get(key)
        if graph is not None and graph.generation == dispatch.generation():
            self.graphs.move_to_end(key)
            return graph(x)
        if graph is not None:  # captured with decisions that tuning has replaced since: capture again now
            del self.graphs[key]
        elif key in self.failed:
            return fn(x)
        elif key not in self.seen or not ready:
            self.seen[key] = None
            if len(self.seen) > self.max_seen:
                self.seen.popitem(last=False)
            return eager_before_capture(fn, x)
        try:
            graph = capture()
        except Exception as err:  # noqa: BLE001 - any capture problem: this signature stays eager
            self.failed.add(key)
            warnings.warn(failure(err), RuntimeWarning, stacklevel=stacklevel + 1)
            return fn(x)
        self.graphs[key] = graph
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph(x)


class GraphCache:
    """Runs fn(x) as a CUDA-graph replay from the second call with the same signature on; the first call runs
    eagerly, so a one-off shape costs no capture. TAESD.encode / decode and TAEHV.encode_video / decode_video use one
    each (`cuda_graphs` on the model).

    A graph bakes in the addresses of the weights and its own memory, so the signature holds the input's shape,
    dtype, device and strides, the dispatch mode, and each parameter's address and version: moving the model,
    changing its dtype or loading new weights in place makes the next call eager and the one after capture anew.
    A graph also bakes in the dispatch decisions: each call first picks up what the tuning process has answered
    (`dispatch.poll`), and when that changed decisions since the capture (`dispatch.generation()` moved), the call
    captures again at once, so the tuned kernels replace cuDNN in the replay without any action from the user.
    The `max_graphs` most recently used graphs are kept (each holds its own memory pool). A signature whose capture
    fails (an op that cannot be captured, out of memory) stays eager, with one warning. (`CapturePolicy`.)"""

    def __init__(self, max_graphs: int = 3):
        self.max_graphs = max_graphs
        self._policy = CapturePolicy(max_graphs, max_seen=64)

    def clear(self) -> None:
        self._policy.clear()

    def __len__(self) -> int:
        return len(self._policy)

    # Copies and pickles of a model start with no graphs (a captured graph cannot be copied or saved).
    def __deepcopy__(self, memo) -> "GraphCache":
        return GraphCache(self.max_graphs)

    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_graphs"])

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list,
                 extra: tuple = ()) -> torch.Tensor:
        """fn(x), eagerly or as a replay. `extra`: hashable flags fn depends on besides x and the weights (e.g.
        TAEHV.decode_video's uint8 and chunking); they go into the signature."""
        if not _replayable(x, params):
            return fn(x)
        if x.is_cuda and x.device.index != torch.cuda.current_device():  # capture and replay on the input's GPU
            with torch.cuda.device(x.device):
                return self._call(fn, x, params, extra)
        return self._call(fn, x, params, extra)

    def _call(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list,
              extra: tuple) -> torch.Tensor:
        return self._policy.run(
            fn, x, params, extra, capture=lambda: CUDAGraphed(fn, x), stacklevel=3,
            failure=lambda e: (f"taesd_fast: CUDA-graph capture failed for input {tuple(x.shape)} {x.dtype} "
                               f"({type(e).__name__}: {e}); these calls stay eager"))
