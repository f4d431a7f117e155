"""Whole-call CUDA graphs: at small batches (live previews, B=1) launch gaps dominate, and one graph replay
removes them. Measured on the H200 (BENCHMARKS.md, run G): TAESD decode 256² B=1 takes 2.9 ms eagerly in auto mode
and 0.235 ms as a graph replay (whose layers were timed as graph replays: our tensor-core convs throughout)."""

from __future__ import annotations

from typing import Callable

import torch

from . import dispatch


def capture(fn: Callable[[], torch.Tensor]):
    """Capture fn() in a CUDA graph after a side-stream warm-up (as capture requires; the warm-up also lets the
    dispatcher time and load its kernels, timing candidates as graph replays: `dispatch.graph_timing`).
    Returns (replay, output): replaying rewrites `output` in place. fn must read its inputs from the same buffers
    every call."""
    with dispatch.graph_timing():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = fn()
    return graph.replay, output


class CUDAGraphed:
    """fn(x) captured once for x's shape, dtype and device; each call copies x in and replays the graph.

        preview = CUDAGraphed(taesd.decode, latents)   # captures (runs the decode a few times)
        image = preview(next_latents)                   # same shape: one graph replay

    Returns a new tensor each call (the graph's own output buffer is overwritten by the next replay).
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor):
        if not (isinstance(example, torch.Tensor) and example.is_cuda):
            raise ValueError("CUDAGraphed needs an example CUDA tensor (CUDA graphs run on the GPU only)")
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
