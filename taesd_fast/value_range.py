"""A warning for images (TAESD) or video frames (TAEHV) whose values are far outside the range the encoder expects
(0-255 values, or [-1, 1] images given where [0, 1] is expected): the encoder would run and return
plausible-looking but wrong latents.

The check is one `torch.aminmax` pass and one read of its two values. On the CPU that costs well under 1% of an
encode, so every call is checked. On CUDA the read waits for the GPU, which would stall the launch queue on every
call of a hot loop, so each input signature (shape, dtype, device) is checked once: on its first call, which runs
eagerly anyway (the CUDA-graph cache replays from the second). Inside torch.compile or a CUDA-graph capture there is
no check at all (a read there would break the graph or the capture).
"""

from __future__ import annotations

import warnings

import torch

from .validation import user_stacklevel

# How to rescale 0-255 values into each range an encoder takes.
_FROM_255 = {(0.0, 1.0): "divide by 255", (-1.0, 1.0): "use x / 127.5 - 1"}


def range_hint(low: float, high: float, expected: tuple[float, float]) -> str | None:
    """Why images with values in [low, high] are probably not in the `expected` range, or None if they may be.

    Small overshoots (resampling filters ring by a few percent) pass; a range more than half its own width beyond
    `expected` does not."""
    lo, hi = expected
    span = hi - lo
    if high > hi + span and low >= lo - span / 2 and high <= 255.5:
        return f"looks like 0-255 pixel values; {_FROM_255.get(expected, f'rescale them to [{lo:g}, {hi:g}]')}"
    if expected == (0.0, 1.0) and low < -0.5 and low >= -1.01 and high <= 1.5:
        return "looks like [-1, 1] images; use (x + 1) / 2"
    if low < lo - span / 2 or high > hi + span / 2:
        return f"values far outside [{lo:g}, {hi:g}] (normalised with a mean and std?); rescale them to [{lo:g}, {hi:g}]"
    return None


def warn_if_unusual_range(images: torch.Tensor, expected: tuple[float, float] = (0.0, 1.0),
                          checked: set | None = None, what: str = "images") -> None:
    """warnings.warn when `images` lie far outside `expected` (see range_hint). `checked`: the CUDA signatures
    (with the expected range) already checked for this model (CUDA inputs are checked once per signature; see the
    module docstring). what: how the message names the input ("images"; TAEHV says "video frames"). The
    warning names the user's line that called into the package."""
    if images.numel() == 0 or images.device.type == "meta" or torch.compiler.is_compiling():
        return
    if images.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return
        key = (tuple(images.shape), images.dtype, images.device, tuple(expected))  # [0, 1] and [-1, 1] callers apart
        if checked is not None:
            if key in checked:
                return
            checked.add(key)
    low, high = (float(v) for v in torch.aminmax(images.detach()))
    hint = range_hint(low, high, tuple(float(v) for v in expected))
    if hint is not None:
        lo, hi = expected
        warnings.warn(f"{what} range over [{low:.4g}, {high:.4g}] but the encoder expects [{lo:g}, {hi:g}]: {hint}",
                      stacklevel=user_stacklevel())
