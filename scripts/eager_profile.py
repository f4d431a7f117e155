#!/usr/bin/env python3
"""Where eager (non-graph) TAESD calls spend host CPU time: cProfile of decode 256² B=1 in auto mode and with
backend("torch") (the channels_last cuDNN path), same process.

    python3 scripts/eager_profile.py [--calls 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast import backend  # noqa: E402
from taesd_fast.taesd import TAESD  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    model = TAESD("taesd").cuda().half().eval()
    x = torch.randn(1, 4, 32, 32, device="cuda", dtype=torch.float16)
    for mode in ("auto", "torch"):
        with torch.no_grad(), backend(mode):
            for _ in range(5):
                model.decode(x)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.calls):
                model.decode(x)
            prof.disable()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / args.calls * 1e3
        print(f"== mode {mode}: {ms:.3f} ms per decode (under cProfile)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
