#!/usr/bin/env python3
"""The floor under a B=1 decode: what one kernel costs in a chain of dependent launches inside a CUDA graph, when
it does (almost) nothing. A decode is ~35 such launches in a row; this prices the boundaries alone.

    python3 scripts/launch_floor.py

Kernels (Triton): `empty` does nothing; `touch` reads a 64x64 f16 tile per program from the previous kernel's output
and writes it on (a minimal data dependence, like a conv's input and output). Each is timed as CHAIN launches back
to back in one graph, with and without programmatic dependent launch (griddepcontrol.wait first, as the conv
kernels do), us per launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast.timing import chain_us

CHAIN = 35


@triton.jit
def _empty(p, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _touch(src, dst, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * 4096 + tl.arange(0, 4096)
    tl.store(dst + offs, tl.load(src + offs) + 1.0)


def main() -> None:
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"us per launch in a graph of {CHAIN} dependent launches")
    bufs = [torch.randn(256 * 4096, device="cuda").half() for _ in range(2)]
    for kind in ("empty", "touch"):
        for grid in (1, 16, 132, 256):
            row = []
            for pdl in (False, True):
                extra = {"launch_pdl": True} if pdl else {}

                def launch(i, grid=grid, pdl=pdl, extra=extra, kind=kind):
                    if kind == "empty":
                        _empty[(grid,)](bufs[0], PDL=pdl, **extra)
                    else:
                        _touch[(grid,)](bufs[i % 2], bufs[1 - i % 2], PDL=pdl, **extra)

                row.append(chain_us(launch, CHAIN))
            print(f"{kind:6s} grid {grid:4d}: {row[0]:5.2f} us without PDL, {row[1]:5.2f} with", flush=True)


if __name__ == "__main__":
    main()
