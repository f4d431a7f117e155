"""`taesd-fast tune`: tune the dispatcher for given shapes ahead of deployment and print what it chose.

    taesd-fast tune --shape 1x32x32x32 --shape 64x32x32x32 [--encode] [--weights ...] [--dtype ...]

A shape is the decoder's latents B x C x h x w, or an image size B x H x W in pixels. With --encode the encoder is
tuned too, on the images those latents decode to. Timings go to the cache dir (TAESD_FAST_CACHE_DIR), where every
later process on this machine finds them.

cli.py wires it in: `tune_cli.add_parser(sub, add_model_arguments, load_model)` (passing its own helpers keeps
this module free of an import of cli.py, which imports it).
"""

from __future__ import annotations

import argparse
import functools
import time


def parse_shape(text: str) -> tuple[int, ...]:
    """"1x32x32x32" -> (1, 32, 32, 32); 3 or 4 positive integers."""
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (3, 4) or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: expected latents BxCxhxw (e.g. 1x32x32x32) or an image size BxHxW in pixels")
    return shape


def add_parser(subparsers, add_model_arguments, load_model) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="tune the kernels for given shapes ahead of deployment",
        description="Time the candidate kernels of every layer for each shape (eager calls and CUDA-graph replays) "
                    "and store the timings in the cache dir, so no later call of these shapes, in any process on "
                    "this machine, runs PyTorch while it tunes. Prints the dispatch table.")
    p.add_argument("--shape", type=parse_shape, action="append", required=True, metavar="BxCxhxw",
                   help="decoder latents (e.g. 1x32x32x32) or an image size BxHxW; repeat for several shapes")
    p.add_argument("--encode", action="store_true", help="also tune the encoder, on the images of those shapes")
    add_model_arguments(p)
    p.set_defaults(func=functools.partial(run, load_model=load_model))
    return p


def run(args: argparse.Namespace, load_model) -> int:
    from .. import dispatch
    from ..dispatch import store

    model = load_model(args, encoder=args.encode)
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("tuning times GPU kernels: it needs a CUDA device (--device cuda)")
    shapes = []
    for shape in args.shape:
        if len(shape) == 4 and shape[1] != model.latent_channels:
            raise ValueError(f"--shape {'x'.join(map(str, shape))}: {model.variant} latents have "
                             f"{model.latent_channels} channels, got {shape[1]}")
        # Pixels serve both parts; latents B x C x h x w decode to B x (h*f) x (w*f).
        shapes.append(shape if len(shape) == 3 else (shape[0], shape[2] * model.downscale, shape[3] * model.downscale))
    tick = time.perf_counter()
    table = model.warmup(shapes, part="both" if args.encode else "decoder")
    print(table)
    print(f"tuned {len(shapes)} shape(s) in {time.perf_counter() - tick:.1f} s; timings in {store.timings_path()}"
          f" (dispatch mode {dispatch.get_backend()})")
    return 0
