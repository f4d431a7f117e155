#!/usr/bin/env python3
"""Launch configs for the small convs of a B=1 decode, timed the way the decode runs them: 20 launches of the same
conv back to back in one CUDA graph (programmatic dependent launch on), us per launch. A single-kernel graph replay
(bench_conv_tc.py) adds the replay's own start-up to every number, which hides what a config changes at 5 µs.

    python3 scripts/small_conv_sweep.py [shape filter,...]

Each config is checked first: NaN-poisoned output, error vs an fp32 conv <= 2x PyTorch f16's.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast.kernels import conv_tc as tc
from taesd_fast.timing import chain_us

CHAIN = 20
P = lambda m, w, s, k=0: tc.TCConfig(m, w, s, block_k=k)
POINTER = [P(64, 4, 3), P(64, 4, 2), P(64, 4, 5), P(64, 4, 9), P(32, 4, 3), P(32, 4, 5), P(32, 4, 9), P(32, 2, 5),
           P(64, 4, 5, 32), P(64, 4, 10, 32), P(128, 4, 3), P(128, 8, 5), P(16, 1, 5), P(16, 1, 9),
           tc.TCConfig(64, 4, 3, small_tile=True)]  # the latency kernels (64->64, upsample, 64->3; else falls back)
WIDE = [tc.TCConfig(128, 4, 3, tile_w=16, halo_w=128), tc.TCConfig(128, 4, 3, tile_w=16, halo_w=64),
        tc.TCConfig(64, 4, 3, tile_w=16), tc.TCConfig(128, 4, 3, tile_w=16)]
# name, C_in, C_out, H, W, upsample, residual, relu, pre_clamp
SHAPES = [
    ("64->64 32^2 b+relu", 64, 64, 32, 32, 1, False, True, False),
    ("64->64 32^2 b+r+relu", 64, 64, 32, 32, 1, True, True, False),
    ("64->64 64^2 b+relu", 64, 64, 64, 64, 1, False, True, False),
    ("64->64 128^2 b+relu", 64, 64, 128, 128, 1, False, True, False),
    ("64->64 128^2 b+r+relu", 64, 64, 128, 128, 1, True, True, False),
    ("64->64 256^2 b+relu", 64, 64, 256, 256, 1, False, True, False),
    ("up2 64->64 32->64^2", 64, 64, 32, 32, 2, False, False, False),
    ("up2 64->64 64->128^2", 64, 64, 64, 64, 2, False, False, False),
    ("up2 64->64 128->256^2", 64, 64, 128, 128, 2, False, False, False),
    ("64->3 256^2 b", 64, 3, 256, 256, 1, False, False, False),
    ("64->3 128^2 b", 64, 3, 128, 128, 1, False, False, False),
    ("clamp 4->64 32^2 b+relu", 4, 64, 32, 32, 1, False, True, True),
]


def rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    cl = torch.channels_last
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; us per launch in a chain of {CHAIN}")
    for name, cin, cout, H, W, up, res, relu, clamp in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
        x = torch.randn(1, cin, H, W, device="cuda", generator=g).half().contiguous(memory_format=cl)
        w = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (3 * cin**0.5)).half().contiguous(memory_format=cl)
        b = (torch.randn(cout, device="cuda", generator=g) * 0.5).half()
        oshape = tc.output_shape(x.shape, w.shape, 1, up)
        r = torch.randn(oshape, device="cuda", generator=g).half().contiguous(memory_format=cl) if res else None
        args = (x, w, b, r, 1, relu, up, clamp)
        ref = tc.conv3x3_math(*args, dtype=torch.float64)
        torch_err = rel(tc.conv3x3_math(*args), ref)
        y = torch.empty(oshape, dtype=torch.float16, device="cuda", memory_format=cl)
        M = H * W if up == 2 else oshape[2] * oshape[3]
        default = tc.default_config(cin, cout, 1, up, M)
        configs = [default] + [c for c in POINTER + (WIDE if W >= 64 and not clamp else []) if c != default]
        print(f"\n{name} (default {default}; PyTorch f16 err {torch_err:.2e})", flush=True)
        for cfg in configs:
            try:
                tc.POISON_OUTPUT = True
                tc.conv3x3_tc_launch(*args, config=cfg, out=y)
                tc.POISON_OUTPUT = False
                err = rel(y, ref)
                ok = "ok" if not y.isnan().any() and err <= 2 * torch_err else "BAD"
                us = chain_us(lambda _, cfg=cfg: tc.conv3x3_tc_launch(*args, config=cfg, out=y), CHAIN)
                print(f"  {cfg!s:24s} {us:7.2f} us  err {err:.2e} {ok}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that cannot run (shared memory) is reported, not fatal
                tc.POISON_OUTPUT = False
                torch.cuda.synchronize()
                print(f"  {cfg!s:24s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
