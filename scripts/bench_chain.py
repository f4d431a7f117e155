#!/usr/bin/env python3
"""The Block-chain kernel (kernels/conv_chain.py) against the same Blocks run conv by conv (each conv dispatched in
auto mode, decided as graph replays), at TAESD's B=1 decode levels. Graph replays, us per run of Blocks; errors vs
a float64 model next to PyTorch f16's.

    python3 scripts/bench_chain.py [--levels 32,64,128,256] [--batch 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import dispatch  # noqa: E402
from taesd_fast.kernels import conv_chain as cc  # noqa: E402
from taesd_fast.layers import Block  # noqa: E402
from taesd_fast.timing import graphed, time_ms  # noqa: E402

CONFIGS = [(64, 2, 0), (64, 2, 1), (32, 2, 0), (32, 2, 1), (32, 3, 1), (16, 3, 1), (128, 2, 1)]  # (block_m, per_sm, sync)


def model(x, ws, bs, dtype):
    h = x.to(dtype)
    for i in range(0, len(ws), 3):
        t = F.conv2d(h, ws[i].to(dtype), bs[i].to(dtype), padding=1).relu()
        t = F.conv2d(t, ws[i + 1].to(dtype), bs[i + 1].to(dtype), padding=1).relu()
        h = (F.conv2d(t, ws[i + 2].to(dtype), bs[i + 2].to(dtype), padding=1) + h).relu()
    return h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="32,64,128,256")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; us per run of Blocks, graph replays")
    torch.manual_seed(0)
    for size in map(int, args.levels.split(",")):
        n = 3 if size < 256 else 1  # the decoder's levels: 3 Blocks each, one at full size
        blocks = [Block(64, 64).cuda().half().eval().requires_grad_(False) for _ in range(n)]
        ws = [c.weight for b in blocks for c in (b.conv[0], b.conv[2], b.conv[4])]
        bs = [c.bias for b in blocks for c in (b.conv[0], b.conv[2], b.conv[4])]
        x = torch.randn(args.batch, 64, size, size, device="cuda").half().contiguous(memory_format=torch.channels_last)
        ref = model(x, ws, bs, torch.float64)
        rel = lambda a, ref=ref: ((a.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        print(f"\n{size}^2 B={args.batch}, {n} blocks (PyTorch f16 err {rel(model(x, ws, bs, torch.float16)):.2e})")
        with torch.no_grad(), dispatch.backend("auto"), dispatch.graph_timing():
            per_conv = time_ms(graphed(lambda: dispatch._run_blocks(x, blocks))) * 1e3
        print(f"  per conv (auto, graph-timed choices)   {per_conv:8.2f} us", flush=True)
        for block_m, per_sm, sync in CONFIGS:
            try:
                y = cc.launch(x, ws, bs, block_m=block_m, per_sm=per_sm, sync=sync)
                run = lambda b=block_m, p=per_sm, s=sync: cc.launch(x, ws, bs, block_m=b, per_sm=p, sync=s)  # noqa: E731
                us = time_ms(graphed(run)) * 1e3
                print(f"  chain M{block_m} {per_sm}/SM sync={sync}  {us:8.2f} us  ({per_conv / us:.2f}x)  "
                      f"err {rel(y):.2e}", flush=True)
            except Exception as e:  # noqa: BLE001 - e.g. a cooperative grid too large: report and go on
                torch.cuda.synchronize()
                print(f"  chain M{block_m} {per_sm}/SM sync={sync}  failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    main()
