#!/usr/bin/env python3
"""The decoder's last Block conv and its 64->3 output conv: the fused pair (kernels/conv_tail.py) against the two
convs launched one after the other (conv_tc's default kernels), each timed as a chain of dependent launches in one
CUDA graph (us per pair), with both results checked against a float64 reference.

    python3 scripts/tail_pair_chain.py [B,H,W ...]     # default: 1,256,256 1,512,512 16,256,256
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast.kernels import conv_tail  # noqa: E402
from taesd_fast.kernels import conv_tc as tc  # noqa: E402
from taesd_fast.timing import chain_us  # noqa: E402

CHAIN = 20


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    shapes = [tuple(map(int, s.split(","))) for s in sys.argv[1:]] or [(1, 256, 256), (1, 512, 512), (16, 256, 256)]
    cl = torch.channels_last
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; us per pair in a chain of {CHAIN}")
    for B, H, W in shapes:
        g = torch.Generator(device="cuda").manual_seed(B * H + W)
        rnd = lambda *s, k=1.0: (torch.randn(*s, generator=g, device="cuda") * k).half()  # noqa: E731
        x, r = rnd(B, 64, H, W).contiguous(memory_format=cl), rnd(B, 64, H, W).contiguous(memory_format=cl)
        w, b, w2, b2 = rnd(64, 64, 3, 3, k=1 / 24), rnd(64, k=0.5), rnd(3, 64, 3, 3, k=1 / 24), rnd(3, k=0.5)
        h64 = tc.conv3x3_math(x, w, b, r, 1, True, dtype=torch.float64)
        ref = tc.conv3x3_math(h64.half().double(), w2, b2, None, 1, False, dtype=torch.float64)
        fused = lambda _=0: conv_tail.launch(x, w, b, r, True, w2, b2)  # noqa: E731
        separate = lambda _=0: tc.conv3x3_tc_launch(tc.conv3x3_tc_launch(x, w, b, r, 1, True), w2, b2, None, 1,  # noqa: E731
                                                    False)
        print(f"{B}x{H}x{W}: fused {chain_us(fused, CHAIN):.2f} us (err {rel(fused(), ref):.2e}), separate "
              f"{chain_us(separate, CHAIN):.2f} us (err {rel(separate(), ref):.2e})", flush=True)


if __name__ == "__main__":
    main()
