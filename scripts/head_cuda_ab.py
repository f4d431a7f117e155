"""A/B of the CUDA head g kernel (csrc/head_g_sm90.cu as in the tree) against whole-file variants of it, e.g. a
branch's source saved with `git show BRANCH:taesd_fast/csrc/head_g_sm90.cu > /tmp/v.cu`. A diagnostic, not a test:

1. every variant is launched on the same random inputs with NaN-filled outputs, on shapes with whole and partial
   tiles, with and without a cache, and its g and new cache compared bit for bit with the tree's;
2. each variant is launched --repeats more times per shape against the tree's outputs (a lost slot handover shows
   as a run that differs: BENCHMARKS.md run FF5);
3. the tree's kernel and the variants are timed alone as CUDA-graph replays at the Wan chunk (T=4 and T=1, + 2
   cached, 352x640), alternately, three times each.

    python3 scripts/head_cuda_ab.py [--repeats N] variant.cu [variant.cu ...]

Run with a timeout on the device: a variant that deadlocks (e.g. setmaxnreg asking for more registers than the
launch has, BENCHMARKS.md run FF8) hangs the process.
"""

from __future__ import annotations

import argparse
import shutil

import torch

from kernel_variants import wan_head_chunk  # beside this script
from taesd_fast import _backend
from taesd_fast.kernels import head_cuda
from taesd_fast.timing import graphed, time_ms

# (T, H, W, with a cache): whole and partial tiles, at most one tile per program (64x72), the first chunk (T=1).
SHAPES = [(4, 352, 640, True), (1, 352, 640, True), (2, 37, 40, True), (3, 64, 72, True), (4, 64, 72, False),
          (1, 352, 640, False), (5, 96, 128, False)]


def install(path: str, index: int) -> str:
    """Copy a variant beside the real source (a git-ignored _probe_ name) and return the name launch() takes."""
    name = f"_probe_ab{index}.cu"
    shutil.copy(path, _backend._CSRC / name)
    _backend.ARCH_SPECIFIC[name] = 90
    return name


def outputs(x, cache, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    x.g.fill_(float("nan"))
    x.nc.fill_(float("nan"))
    head_cuda.launch(x.feat, cache, x.gs, x.wt, x.g, x.nc, 1e-12, source=source)
    return x.g.clone(), x.nc.clone()


def compare(variants: dict[str, str], repeats: int) -> None:
    for t, h, w, with_cache in SHAPES:
        x = wan_head_chunk(t, h=h, w=w)
        cache = x.cache if with_cache else None
        want_g, want_nc = outputs(x, cache, head_cuda.SOURCE)
        for label, source in variants.items():
            differing = 0
            for _ in range(1 + repeats):
                g, nc = outputs(x, cache, source)
                differing += not (torch.equal(g, want_g) and torch.equal(nc, want_nc))
            print(f"T={t} {h}x{w} cache={with_cache}: {label}: {differing} of {1 + repeats} runs differ "
                  f"(g NaN in the last: {int(g.isnan().sum())})", flush=True)


def timings(variants: dict[str, str]) -> None:
    for t in (4, 1):
        x = wan_head_chunk(t)
        replays = {label: graphed(lambda s=source: head_cuda.launch(x.feat, x.cache, x.gs, x.wt, x.g, x.nc, 1e-12,
                                                                    source=s))
                   for label, source in {"tree": head_cuda.SOURCE, **variants}.items()}
        times = {label: [] for label in replays}
        for _ in range(3):
            for label, replay in replays.items():
                times[label].append(time_ms(replay))
        for label, ms in times.items():
            print(f"T={t} + 2 cached, 352x640: {label:30s} " + " ".join(f"{m:.4f}" for m in ms) + " ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="whole-file variants of csrc/head_g_sm90.cu")
    parser.add_argument("--repeats", type=int, default=10, help="extra launches per shape and variant")
    args = parser.parse_args()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    variants = {path: install(path, i) for i, path in enumerate(args.variants)}
    try:
        compare(variants, args.repeats)
        timings(variants)
    finally:
        for name in variants.values():
            (_backend._CSRC / name).unlink()


if __name__ == "__main__":
    main()
