#!/usr/bin/env python3
"""Kernel timeline of one graph-replayed TAESD decode (torch.profiler / CUPTI): start, duration and the gap before
each kernel, in the order they ran. Shows where a B=1 decode's time goes: kernels, or the gaps between them.

    python3 tools/decode_timeline.py [--size 256] [--batch 1] [--variant taesd]

The model has random weights (the timeline does not depend on them). The decoder is captured with
taesd_fast.graphs.graphed inside dispatch.tuning("blocking"): the capture's warm-up calls tune every layer for graph
replays first (as a tuned `taesd.decode` replays them), so the timeline shows the kernels the dispatcher chose.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import TAESD, dispatch
from taesd_fast.graphs import graphed
from taesd_fast.timing import time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variant", default="taesd")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    model = TAESD(args.variant).cuda().half().eval()
    model.cuda_graphs = False
    f = model.downscale
    z = TAESD.preferred_layout(torch.randn(args.batch, model.latent_channels, args.size // f, args.size // f,
                                           device="cuda", dtype=torch.float16))  # as decode() hands it on
    with torch.no_grad(), dispatch.backend("auto"), dispatch.tuning("blocking"):
        replay = graphed(lambda: model.decoder(z))
        print(f"decode {args.size}² B={args.batch} graph replay: {time_ms(replay) * 1e3:.1f} us", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        events = json.loads(Path(f"{d}/trace.json").read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(kernels) // 3
    if per == 0:
        print("the profiler recorded no kernels inside the graph replay")
        return
    last = kernels[-per:]
    t0, prev_end, busy = last[0]["ts"], last[0]["ts"], 0.0
    print(f"{per} kernels per replay; the last replay:")
    print(f"{'#':>3} {'start':>8} {'dur':>7} {'gap':>6}  kernel (grid)")
    for i, e in enumerate(last):
        gap = e["ts"] - prev_end
        grid = e.get("args", {}).get("grid", "")
        print(f"{i:3d} {e['ts'] - t0:8.2f} {e['dur']:7.2f} {gap:6.2f}  {e['name'][:60]} {grid}")
        prev_end = max(prev_end, e["ts"] + e["dur"])
        busy += e["dur"]
    span = prev_end - t0
    print(f"span {span:.1f} us, sum of kernel durations {busy:.1f} us (overlap through PDL makes the sum exceed "
          f"the span)")
    print(dispatch.dispatch_table(model))


if __name__ == "__main__":
    main()
