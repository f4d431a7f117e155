#!/usr/bin/env python3
"""A kernel-module switch off and on: whole TAESD decodes replayed from CUDA graphs, in one process with the same
dispatch decisions, alternating the two values twice; also checks both give the same bits.

    python3 scripts/flag_ab.py conv_tc.PDL=False,True          # programmatic dependent launch (run M)
    python3 scripts/flag_ab.py conv_halo.NARROW_PER_SM=1,2     # 64->3 row runs sized for 2 programs per SM

The switch is a module-level name under taesd_fast.kernels; values are Python literals.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast.graphs import capture  # noqa: E402
from taesd_fast.taesd import TAESD  # noqa: E402
from taesd_fast.timing import time_ms  # noqa: E402

WORKLOADS = [("decode 256² B=1", 1, 256), ("decode 512² B=1", 1, 512), ("decode 1024² B=1", 1, 1024),
             ("decode 256² B=16", 16, 256), ("decode 256² B=64", 64, 256)]


def main() -> None:
    switch, values = sys.argv[1].split("=")
    module_name, name = switch.rsplit(".", 1)
    module = importlib.import_module(f"taesd_fast.kernels.{module_name}")
    a, b = (ast.literal_eval(v) for v in values.split(","))
    original = getattr(module, name)
    torch.backends.cudnn.benchmark = True
    model = TAESD("taesd").cuda().half().eval()
    model.cuda_graphs = False  # captured here, explicitly
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; {switch} = {a!r} vs {b!r}")
    for label, batch, size in WORKLOADS:
        x = torch.randn(batch, 4, size // 8, size // 8, device="cuda", dtype=torch.float16)
        times, outs = {a: [], b: []}, {}
        for value in (a, b, a, b):
            setattr(module, name, value)
            with torch.no_grad():
                replay, out = capture(lambda: model.decode(x))
            times[value].append(time_ms(replay))
            outs[value] = out.clone()
        same = torch.equal(outs[a], outs[b])
        print(f"{label}: {a!r} {' '.join(f'{t:.4f}' for t in times[a])} ms, {b!r} "
              f"{' '.join(f'{t:.4f}' for t in times[b])} ms, same bits: {same}", flush=True)
    setattr(module, name, original)


if __name__ == "__main__":
    main()
