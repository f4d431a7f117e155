"""TAEHV streaming: the state a stream carries, CUDA-graph capture and replay of a step, and input checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import dispatch, graphs


@dataclass
class StreamState:
    """What a stream carries between steps: each memory block's input at the last frame (updated in place), the
    shapes it was made for, the step count, and (on CUDA) the step's captured graph. Start a stream with None."""

    part: str  # "encoder" | "decoder"
    signature: tuple  # (batch, height, width, dtype, device, preview) of the inputs it was made for
    memory: list = field(repr=False)
    steps: int = 0
    # One graph per stream (it reads and writes this state's memory); a step seen once runs eagerly.
    _graphs: graphs.CapturePolicy = field(default_factory=lambda: graphs.CapturePolicy(max_graphs=1, max_seen=1),
                                          repr=False)

    @property
    def _graph(self) -> "_Graph | None":
        """The step's captured graph, if any."""
        return self._graphs.latest()


@dataclass
class _Graph:
    generation: int  # dispatch.generation() when captured: tuning since then makes the graph stale
    input: torch.Tensor
    replay: object
    output: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.input.copy_(x)
        self.replay()
        return self.output.clone()


def _capture(step, x: torch.Tensor, memory: list) -> _Graph:
    """step captured for x's shape. Capturing runs the step (warm-up) on the state's memory: it is kept and put
    back, whether the capture succeeds or fails, so the real step continues the stream where it was."""
    saved = [m.clone() for m in memory]
    static = x.clone()
    generation = dispatch.generation()  # read before the warm-up decides: a later change makes the graph stale
    try:
        replay, output = graphs.capture(lambda: step(static))
    finally:
        for m, s in zip(memory, saved):
            m.copy_(s)
    return _Graph(generation, static, replay, output)


def graphed_step(step, x: torch.Tensor, params: list, state: StreamState, tag) -> torch.Tensor:
    """step(x) for a stream on CUDA: eager on a shape's first call, then captured and replayed. The graph reads
    and writes the state's own memory tensors, so a replay continues the stream with no copies; capturing runs the
    step twice to warm up, which changes that memory, so it is saved and put back before the real step. The key
    holds what the graph bakes in (`graphs.signature`: shape, strides, dispatch mode, the weights' addresses and
    versions; and `tag`, e.g. the uint8 output flag): a change runs eagerly once and then captures anew. Each step
    first picks up what the tuning process has answered (`dispatch.poll`); when that changed decisions since the
    capture, the step captures again with the tuned kernels. Where capture fails (with one warning), the step runs
    eagerly (`graphs.CapturePolicy`). Returns a fresh tensor."""
    return state._graphs.run(
        step, x, params, (tag,), capture=lambda: _capture(step, x, state.memory), stacklevel=3,
        ready=all(m is not None for m in state.memory),  # the first step makes the memory: eager
        failure=lambda err: (f"taesd_fast: CUDA-graph capture of a TAEHV step failed for input {tuple(x.shape)} "
                             f"({type(err).__name__}: {err}); this stream's steps stay eager"))


def replayable(x: torch.Tensor) -> bool:
    """Whether a step may run as a graph: a CUDA input, outside torch.compile and outside another capture."""
    return x.is_cuda and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()


def check_video(x, name: str, channels: int, like: torch.Tensor, multiple: int = 1) -> None:
    """x must be an NTCHW float tensor with `channels` at dim 2 on like's device and dtype; one-line errors."""
    layout = "[N, T, C, H, W] (NTCHW)"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != 5:
        hint = " (one frame? add a time dimension with .unsqueeze(1))" if x.dim() == 4 else ""
        raise ValueError(f"{name} must have 5 dims {layout}, got shape {tuple(x.shape)}{hint}")
    if x.shape[2] != channels:
        if x.shape[1] == channels:
            raise ValueError(f"{name} of shape {tuple(x.shape)} looks NCTHW (channels at dim 1); TAEHV takes NTCHW "
                             f"with {channels} channels at dim 2: pass {name}.transpose(1, 2)")
        raise ValueError(f"{name} must have {channels} channels at dim 2 {layout}, got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has 0 frames (shape {tuple(x.shape)}); at least 1 is needed")
    if 0 in x.shape:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)} {layout}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point ({like.dtype} for this model), got {x.dtype}"
                        + ("; convert uint8 frames with x.float() / 255" if x.dtype == torch.uint8 else ""))
    if x.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the model is {like.dtype}; use {name}.to({like.dtype})")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the model is on {like.device}; move one of them")
    if x.shape[-2] % multiple or x.shape[-1] % multiple:
        raise ValueError(f"{name} frames are {x.shape[-1]}x{x.shape[-2]} pixels; the encoder needs multiples of "
                         f"{multiple} on each side: pad or resize first")
