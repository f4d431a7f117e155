"""Progress bars for encodes and decodes that may run long (large images on a CPU take minutes): a tqdm bar over the
layers a call runs, tile by tile when it is tiled, so that even one untiled image shows it is moving.

Each bar appears only after DELAY seconds, so quick calls (and every call on a GPU) print nothing. The layers are
counted by forward hooks on the encoder's or decoder's top-level layers that hold weights (convs and Blocks: the
Sequential folds ReLUs, upsamples and the clamp into the conv after them, so those are not called on their own);
the hooks are removed when the call ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from . import tiling

DELAY = 2.0  # seconds before a bar is shown


def counted_layers(layers: nn.Sequential) -> list[nn.Module]:
    """The top-level layers of `layers` that a progress bar counts: those with weights, which always run."""
    return [layer for layer in layers if next(layer.parameters(), None) is not None]


def layer_calls(model, part: str, x: torch.Tensor, tile: int | None, overlap: int) -> tuple[int, int]:
    """(counted layer calls, windows) of one run of model.encoder / decoder on x: untiled every layer runs once
    (1 window); tiled, the untiled head and tail once and the middle once per window (tiling.py)."""
    layers = getattr(model, part)
    if tile is None:
        return len(counted_layers(layers)), 1
    head, middle, tail = tiling.split_global(part, layers)
    f = model.downscale
    height, width = (n // f for n in tiling.image_size(model, part, x))
    windows = (len(list(tiling._windows(height, tile // f, overlap // f)))
               * len(list(tiling._windows(width, tile // f, overlap // f))))
    calls = len(counted_layers(head)) + windows * len(counted_layers(middle)) + len(counted_layers(tail))
    return calls, windows


@contextmanager
def layer_progress(layers: nn.Sequential, total: int, desc: str) -> Iterator[None]:
    """While the block runs, a tqdm bar (on stderr, after DELAY seconds, removed when done) counts the calls of
    `layers`' counted layers up to `total`."""
    from tqdm import tqdm

    def count(*_) -> None:  # a forward hook: returning None keeps the layer's output
        bar.update()

    with tqdm(total=total, desc=desc, unit="layer", delay=DELAY, leave=False) as bar:
        handles = [layer.register_forward_hook(count) for layer in counted_layers(layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def item_progress(total: int, desc: str, unit: str) -> Iterator:
    """A tqdm bar over a command's items (the images of a folder), shown after DELAY seconds when there are
    several; yields it, for `bar.update()` and `bar.write(line)` (printed above the bar)."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, delay=DELAY, disable=total < 2) as bar:
        yield bar
