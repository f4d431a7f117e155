#!/usr/bin/env python3
"""Programmatic dependent launch (conv_tc.PDL) off and on: whole TAESD decodes replayed from CUDA graphs, in one
process with the same dispatch decisions, alternating off/on twice; also checks both give the same bits.

    python3 scripts/pdl_ab.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast.graphs import capture  # noqa: E402
from taesd_fast.kernels import conv_tc  # noqa: E402
from taesd_fast.taesd import TAESD  # noqa: E402
from taesd_fast.timing import time_ms  # noqa: E402

WORKLOADS = [("decode 256² B=1", 1, 256), ("decode 512² B=1", 1, 512), ("decode 1024² B=1", 1, 1024),
             ("decode 256² B=64", 64, 256)]


def main() -> None:
    torch.backends.cudnn.benchmark = True
    model = TAESD("taesd").cuda().half().eval()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, batch, size in WORKLOADS:
        x = torch.randn(batch, 4, size // 8, size // 8, device="cuda", dtype=torch.float16)
        times, outs = {False: [], True: []}, {}
        for pdl in (False, True, False, True):
            conv_tc.PDL = pdl
            with torch.no_grad():
                replay, out = capture(lambda: model.decode(x))
            times[pdl].append(time_ms(replay))
            outs[pdl] = out.clone()
        same = torch.equal(outs[False], outs[True])
        print(f"{name}: PDL off {' '.join(f'{t:.4f}' for t in times[False])} ms, on "
              f"{' '.join(f'{t:.4f}' for t in times[True])} ms, same bits: {same}", flush=True)
    conv_tc.PDL = True


if __name__ == "__main__":
    main()
