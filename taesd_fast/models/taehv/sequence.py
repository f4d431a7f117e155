"""Running a TAEHV encoder or decoder Sequential over frames with the memory blocks' state, and the activation
memory such a run needs.

`run_sequence` walks a Sequential over k frames per sample given each memory block's input at the frame before the
first one (zeros at the start of a video), and writes each block's last input back into that memory. One function
therefore serves the whole-video decode (k = T, zero memory) and the streaming step (k = frames per step, carried
memory). `live_elements` and `sizes_at` walk the same layer groups to size decode_video's chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import dispatch, graphs
from ...dispatch.torch_ops import past_frames
from ..layers import Clamp, DispatchConv2d
from .layers import MemBlock, SuperMemBlock, TGrow, TPool, grow_conv, weight_rows


def memory_indices(seq: nn.Sequential) -> list[int]:
    """Positions of the memory blocks, in order: one memory tensor each."""
    return [i for i, m in enumerate(seq) if isinstance(m, (MemBlock, SuperMemBlock))]


@dataclass(frozen=True)
class Preview:
    """Per-stage switches of the decoder's upscaling (the preview knobs): False turns a stage's time or space
    upscale off. Time off: TGrow keeps the last frame's rows of its weight. Space off: the base decoder skips the
    nearest upsample; the super decoder keeps the top-left sub-pixel rows of the conv before its pixel shuffle (the
    even-pixel samples of the full-resolution features)."""

    time: tuple = (True, True, True)
    space: tuple = (True, True, True)


def run_sequence(seq: nn.Sequential, x: torch.Tensor, batch: int, memory: list,
                 preview: Preview | None = None, start: int = 0, stop: int | None = None,
                 batch_memory: bool = False, project: bool = False) -> torch.Tensor:
    """Apply an encoder or decoder Sequential to x [batch*k, C, H, W] (k frames per sample, time-major).

    memory[j]: the j-th memory block's input at the frame before the first, [batch, C_j, H_j, W_j], or None for
    zeros (the start of a video); overwritten in place (or set, where None) with its input at the last frame.
    preview: the decoder's upscale switches (None: all on).
    start, stop: run only seq[start:stop] (x is then the input of seq[start]); both must fall between layer groups,
    e.g. at a memory block (`memory_indices`). decode_video runs the low-resolution layers on long chunks and the
    full-resolution ones on short chunks of their output.
    batch_memory: the streaming step's memory writes, which keep every block's input alive until the step ends
    (so long chunks do not batch). With `project`'s side stream, each block's copy runs there as soon as it may,
    beside the main stream's later layers; without it, one multi-tensor copy right after the last memory block,
    instead of one small kernel per block (after the last block, the full-resolution layers have not yet pushed the
    blocks' inputs out of L2).
    project: compute the memory half of the first conv of each base memory block that sees one frame per sample
    ahead, on a side stream on CUDA (`MemoryProjections`; the streaming step, which runs every memory block).
    """
    modules = list(seq)
    stop = len(modules) if stop is None else stop
    mem = iter(range(sum(isinstance(m, (MemBlock, SuperMemBlock)) for m in modules[:start]), len(memory)))
    stage = sum(isinstance(m, TGrow) for m in modules[:start])
    pending: list | None = [] if batch_memory else None
    if project and (start != 0 or any(isinstance(m, (MemBlock, SuperMemBlock)) for m in modules[stop:])):
        raise ValueError(f"run_sequence(project=True) runs every memory block (start 0, stop after the last), got "
                         f"layers {start}:{stop}")
    projections = MemoryProjections(seq, x.shape[0] // batch, x.is_cuda, memory, preview) if project else None
    i = start
    while i < stop:
        m = modules[i]
        nxt = modules[i + 1] if i + 1 < len(modules) else None
        if isinstance(m, (MemBlock, SuperMemBlock)):
            j = next(mem)
            projected = projections and projections.take(j)
            if pending is not None and projections is not None and projections.streams is not None:
                # A CUDA step: each block's memory copy runs on the side stream as soon as _memory_step issues it,
                # beside the step's later layers.
                x = _memory_step(m, x, batch, memory, j, projections.copy, projected)
            else:
                x = _memory_step(m, x, batch, memory, j, None if pending is None else
                                 lambda dst, src: pending.append((dst, src)), projected)
                if j == len(memory) - 1:  # the last block: write the memory while its inputs are still in L2
                    _write_memory(projections, pending)
                    projections, pending = None, None
            i += 1
        elif isinstance(m, Clamp) and isinstance(nxt, DispatchConv2d):
            relu = i + 2 < len(modules) and isinstance(modules[i + 2], nn.ReLU)
            x = nxt(x, pre_clamp=True, relu=relu)
            i += 3 if relu else 2
        elif isinstance(m, nn.Upsample):  # base decoder: Upsample, TGrow, conv
            grow, conv = modules[i + 1], modules[i + 2]
            time_on = preview is None or preview.time[stage]
            space_on = preview is None or preview.space[stage]
            relu = i + 3 < len(modules) and isinstance(modules[i + 3], nn.ReLU)  # the last stage's conv
            x = grow_conv(grow, conv, x, time_on, 2 if space_on else 1, relu)
            stage += 1
            i += 4 if relu else 3
        elif isinstance(m, DispatchConv2d) and isinstance(nxt, nn.ReLU) and i + 2 < len(modules) \
                and isinstance(modules[i + 2], nn.PixelShuffle):  # super decoder: conv, ReLU, PixelShuffle, TGrow
            grow = modules[i + 3]
            time_on = preview is None or preview.time[stage]
            if preview is None or preview.space[stage]:
                x = F.pixel_shuffle(m(x, relu=True), 2)
            else:
                weight, bias = weight_rows(m, slice(0, None, 4))
                x = dispatch.conv2d(x, weight, bias, relu=True, layer=m)
            x = grow(x, time_on)
            stage += 1
            i += 4
        elif isinstance(m, DispatchConv2d):
            relu = isinstance(nxt, nn.ReLU)
            x = m(x, relu=relu)
            i += 2 if relu else 1
        else:  # ReLU after a conv is fused above; TPool; a lone ReLU
            x = m(x)
            i += 1
    _write_memory(projections, pending)
    return x


def _write_memory(projections: "MemoryProjections | None", pending: list | None) -> None:
    """The end of a step's memory work: the main stream joins the side stream (whose projections read the memory),
    then the batched memory copies run."""
    if projections is not None:
        projections.join()  # before the memory is overwritten: the side stream reads it
    if pending:
        torch._foreach_copy_([dst for dst, _ in pending], [src for _, src in pending])


class MemoryProjections:
    """The memory half of the first conv of each base memory block that sees one frame per sample, computed before
    its block runs: conv(memory[j], W[:, C:]) + bias, where W is the conv's [C_out, 2C, 3, 3] weight. It reads only
    the memory, which is known when the step starts, so on CUDA these convs run on a side stream, beside the step's
    earlier layers, and the block's first conv is then the x half alone, with the projection as its residual. In a
    step of one latent frame that is every block of the decoder's first two stages, whose small grids leave SMs
    idle. (Blocks of several frames would need the past half of their later frames on the step's path.)

    The side stream also takes the step's memory copies (`copy`), which would otherwise wait on the main stream.

    A projection's tensor and a copy's source live until the step ends (`join`), after every use on the main
    stream; the next step's side-stream work starts behind all of this step's work, so its memory is never reused
    while still read."""

    def __init__(self, seq: nn.Sequential, frames: int, cuda: bool, memory: list, preview: Preview | None):
        """seq: the Sequential a step runs, with `frames` frames per sample into it; memory: its blocks' memory."""
        self.ready: dict = {}
        self.kept: list = []
        blocks = [(seq[i], j) for i, j in _single_frame_blocks(seq, frames, preview) if memory[j] is not None]
        self.streams = (torch.cuda.current_stream(), graphs.side_stream("memory")) if cuda and blocks else None
        if self.streams is not None:
            self.streams[1].wait_stream(self.streams[0])
        with torch.cuda.stream(self.streams[1]) if self.streams else contextlib.nullcontext():
            for block, j in blocks:
                projected = dispatch.conv2d(memory[j], *block.first_half(past=True), layer=block.conv[0])
                event = None
                if self.streams:
                    event = torch.cuda.Event()
                    event.record(self.streams[1])
                self.ready[j] = (projected, event)

    def take(self, j: int) -> torch.Tensor | None:
        """Memory block j's projection (the main stream waits for it), or None where it has none."""
        hit = self.ready.get(j)
        if hit is None:
            return None
        if hit[1] is not None:
            self.streams[0].wait_event(hit[1])
        return hit[0]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) on the side stream, after the main stream's work so far; src is kept until `join`."""
        event = torch.cuda.Event()
        event.record(self.streams[0])
        self.streams[1].wait_event(event)
        with torch.cuda.stream(self.streams[1]):
            dst.copy_(src)
        self.kept.append(src)

    def join(self) -> None:
        """The main stream waits for the side stream (a graph capture must end joined)."""
        if self.streams is not None:
            self.streams[0].wait_stream(self.streams[1])
        self.kept = []


def _single_frame_blocks(seq: nn.Sequential, frames: int, preview: Preview | None) -> list[tuple[int, int]]:
    """(module index, memory index) of each MemBlock of seq that sees one frame per sample, for `frames` frames per
    sample into seq[0] (the frame counts of `_groups`, the walk that sizes decode_video's chunks)."""
    memory = memory_indices(seq)
    found = []
    for first, _, (_, _, after) in _groups(seq, 1, 1, frames, preview):
        if isinstance(seq[first], MemBlock) and frames == 1:
            found.append((first, memory.index(first)))
        frames = after
    return found


def _memory_step(block: nn.Module, x: torch.Tensor, batch: int, memory: list, j: int,
                 write: Callable | None = None, projected: torch.Tensor | None = None) -> torch.Tensor:
    """One memory block over k frames: frame t's past is frame t-1's input (memory[j] for the first). The memory
    then takes the last frame: write(memory[j], last) (default: copied now, on this stream). With a projection of
    the memory (the block then does not read it), the write is issued before the block, so that a side stream's
    copy may run beside it; else after the block."""
    nt, c, h, w = x.shape
    k = nt // batch
    last = x.reshape(batch, k, c, h, w)[:, -1]
    write = write or (lambda dst, src: dst.copy_(src))
    if projected is not None:
        write(memory[j], last)
    out = block(x, memory[j], k, projected) if isinstance(block, MemBlock) \
        else block(x, past_frames(x, memory[j], k))
    if memory[j] is None:
        # A normal tensor even under inference_mode, so a later step outside it may update it in place.
        with torch.inference_mode(False):
            memory[j] = torch.empty_like(last)
    if projected is None:
        write(memory[j], last)
    return out


def live_elements(seq: nn.Sequential, channels: int, height: int, width: int, frames: int = 1,
                  preview: Preview | None = None, output_copies: int = 0, start: int = 0,
                  stop: int | None = None) -> int:
    """The most activation elements alive at once while `run_sequence` takes `frames` frames of `channels` x
    height x width through seq[start:stop] (weights and seq's input itself not counted), on the dispatcher's
    PyTorch path: a conv's ReLU or residual add is a second output-sized tensor, the base decoder's nearest
    upsample a tensor of its own. decode_video / encode_video size their chunks of frames by it, so a long video's
    decode needs the memory of one chunk plus its output. `output_copies`: how many copies of the segment's output
    are alive together after it (the decoder's output, pixel shuffle and clamp: 3)."""
    peak, (c, px, f) = 0, (channels, height * width, frames)
    for first, group_peak, after in _groups(seq, channels, height * width, frames, preview):
        if stop is not None and first >= stop:
            break
        if first >= start:
            peak = max(peak, group_peak)
        c, px, f = after
    return max(peak, output_copies * c * px * f)


def sizes_at(seq: nn.Sequential, channels: int, height: int, width: int, index: int | None, frames: int = 1,
             preview: Preview | None = None) -> tuple[int, int, int]:
    """(channels, pixels per frame, frames) of the input of seq[index] (None: of seq's output), for `frames`
    frames of channels x height x width into seq."""
    sizes = (channels, height * width, frames)
    for first, _, after in _groups(seq, channels, height * width, frames, preview):
        if index is not None and first >= index:
            break
        sizes = after
    return sizes


def _groups(seq: nn.Sequential, c: int, px: int, f: int, preview: Preview | None):
    """Walk seq as `run_sequence` groups its layers: yields (the group's first index, the elements alive together
    in the group, (channels, pixels, frames) of its output). A memory block holds its input, the past frames, the
    concatenation and its convs' outputs; an upsample group its input, TGrow's output, the upsampled tensor and
    the conv's outputs."""
    modules = list(seq)
    stage, i = 0, 0
    while i < len(modules):
        m = modules[i]
        size = c * px * f
        first = i
        if isinstance(m, MemBlock):  # at the first conv: x, past, cat, 2 outputs; at the last: x, past, 5 outputs
            n_in, n_out = m.conv[0].in_channels // 2, m.conv[0].out_channels
            peak = max(4 * n_in + 2 * n_out, 2 * n_in + 5 * n_out) * px * f
            c, i = n_out, i + 1
        elif isinstance(m, SuperMemBlock):  # x, past, the depthwise output (2c), the expansion and its ReLU (4c each)
            peak, i = 12 * size, i + 1
        elif isinstance(m, Clamp):  # the input, its soft clamp, the conv's 2 outputs
            conv = modules[i + 1]
            peak = max(3 * size, 2 * size + 2 * conv.out_channels * px * f)
            c, i = conv.out_channels, i + 2
        elif isinstance(m, nn.Upsample):  # the input, TGrow's output, the upsampled tensor, the conv's 2 outputs
            grow, conv = modules[i + 1], modules[i + 2]
            t = grow.stride if preview is None or preview.time[stage] else 1
            s = 4 if preview is None or preview.space[stage] else 1
            peak = size + c * px * f * t + (c + 2 * conv.out_channels) * s * px * f * t
            c, px, f, stage, i = conv.out_channels, s * px, f * t, stage + 1, i + 3
        elif isinstance(m, DispatchConv2d) and i + 2 < len(modules) and isinstance(modules[i + 2], nn.PixelShuffle):
            grow = modules[i + 3]  # the super decoder's conv, ReLU, pixel shuffle, TGrow
            t = grow.stride if preview is None or preview.time[stage] else 1
            s = 4 if preview is None or preview.space[stage] else 1
            c_out = grow.conv.in_channels
            wide = c_out * s * px * f  # the conv's output (its kept rows when the space upscale is off)
            peak = max(size + 3 * wide, wide + c_out * s * px * f * (1 + t))  # + ReLU, shuffle; then TGrow
            c, px, f, stage, i = c_out, s * px, f * t, stage + 1, i + 4
        elif isinstance(m, DispatchConv2d):
            px_out = px // (m.stride[0] * m.stride[0])
            peak = size + 2 * m.out_channels * px_out * f
            c, px, i = m.out_channels, px_out, i + 1
        elif isinstance(m, TPool):
            peak = size + 2 * size // m.stride
            f, i = f // m.stride, i + 1
        else:  # a ReLU: fused into the conv before it
            peak, i = 0, i + 1
        yield first, peak, (c, px, f)
