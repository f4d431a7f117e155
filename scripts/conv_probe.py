#!/usr/bin/env python3
"""Where the Gluon convs spend their time: variants of kernels/conv_halo.py (row-streaming) and kernels/conv_tile.py
(small tiles) with one part removed each (the MMAs, two of the three dx-shifted input boxes, the weight load) or
put back (the row-streaming kernel's MMAs for rows outside its run),
timed as 20 dependent launches in one CUDA graph, us per launch. A diagnostic, not a test: the variants compute
wrong outputs. Run: python3 scripts/conv_probe.py [shape filter,...]

Reading it: if loading one box per input row instead of three cuts the time, the kernel is bound by the bytes TMA
moves from L2 into shared memory, not by the tensor cores.
"""

from __future__ import annotations

import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from taesd_fast.kernels import conv_halo, conv_tile  # noqa: E402
from taesd_fast.kernels import conv_tc as tc  # noqa: E402
from taesd_fast.timing import chain_us  # noqa: E402

from kernel_variants import load_variant  # noqa: E402  (beside this script)

CHAIN = 20
NO_MMA = (re.compile(r"^( *)acc_\w+(, acc_\w+)* = warpgroup_mma(_wait)?\(.*$", re.M), r"\1pass")  # each MMA and wait
EDITS = {
    conv_halo: {
        "one dx box per row": [("(4 if HAS_RES else 3) * BLOCK_W", "(2 if HAS_RES else 1) * BLOCK_W"),
                               ("        for dx in gl.static_range(3):\n            tma.async_copy_global_to_shared(x_desc",
                                "        for dx in gl.static_range(1, 2):\n            tma.async_copy_global_to_shared(x_desc")],
        "no MMA": [NO_MMA],
        "every MMA (edge steps not skipped)": [("        if (i >= 2) & (row_done + 2 < r_end):  # every MMA",
                                                "        if True:  # every MMA")],
    },
    conv_tile: {
        "one dx box": [("            mbarrier.expect(bars.index(1 + dx), 4 * 64 * 64 * 2)",
                        "            mbarrier.expect(bars.index(1 + dx), 4 * 64 * 64 * 2 * (dx == 1))"),
                       ("            tma.async_copy_global_to_shared(x_desc, [img, y0 - 1, x0 - 1 + dx, 0], bars.index(1 + dx),",
                        "            if dx == 1:\n                tma.async_copy_global_to_shared(x_desc, [img, y0 - 1, x0 - 1 + dx, 0], bars.index(1 + dx),")],
        "no weight load": [("            tma.async_copy_global_to_shared(w_desc, [tap * 64, n0], w_bar, w_smem.index(tap))",
                            "            pass"),
                           ("        mbarrier.wait(w_bar, 0)\n", "")],
        "no MMA": [("            acc0 = _taps(x_smem, w_smem, acc0, 0, dx)\n", ""),
                   ("                acc1 = _taps(x_smem, w_smem, acc1, 1, dx)\n", "                pass\n")],
    },
}
KERNEL_NAME = {conv_halo: "_halo_conv_kernel", conv_tile: "_tile_conv_kernel"}
# name, module, config, B, H, W, C_out, residual
SHAPES = [
    ("row-streaming 64->64 256^2 B=1 b+r+relu", conv_halo, tc.TCConfig(128, 4, 3, tile_w=16, halo_w=128), 1, 256, 256,
     64, True),
    ("row-streaming 64->3 256^2 B=1", conv_halo, tc.TCConfig(128, 4, 3, tile_w=16, halo_w=128), 1, 256, 256, 3, False),
    ("row-streaming 64->64 256^2 B=16 b+r+relu", conv_halo, tc.TCConfig(128, 4, 3, tile_w=16, halo_w=128), 16, 256,
     256, 64, True),
    ("tile 64->64 128^2 B=1 b+r+relu", conv_tile, tc.TCConfig(64, 4, 3, small_tile=True), 1, 128, 128, 64, True),
    ("tile 64->64 32^2 B=1 b+r+relu", conv_tile, tc.TCConfig(64, 4, 3, small_tile=True), 1, 32, 32, 64, True),
]


def main() -> None:
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    cl = torch.channels_last
    print(f"GPU {torch.cuda.get_device_name()}; us per launch in a chain of {CHAIN}")
    for label, module, cfg, B, H, W, cout, res in SHAPES:
        if wanted and not any(w in label for w in wanted):
            continue
        x = torch.randn(B, 64, H, W, device="cuda").half().contiguous(memory_format=cl)
        w = (torch.randn(cout, 64, 3, 3, device="cuda") / 24).half()
        b = torch.randn(cout, device="cuda").half()
        r = torch.randn(B, cout, H, W, device="cuda").half().contiguous(memory_format=cl) if res else None
        y = torch.empty(B, cout, H, W, device="cuda", dtype=torch.float16, memory_format=cl)
        original = getattr(module, KERNEL_NAME[module])
        row = []
        for name, edits in [("baseline", [])] + list(EDITS[module].items()):
            kernel = getattr(load_variant(module, name, edits), KERNEL_NAME[module]) if edits else original
            setattr(module, KERNEL_NAME[module], kernel)
            try:
                launch = lambda _, cfg=cfg: tc.conv3x3_tc_launch(x, w, b, r, 1, True, config=cfg, out=y)  # noqa: E731
                us = chain_us(launch, CHAIN)
                row.append(f"{name} {us:.2f}")
            except Exception as e:  # noqa: BLE001  a variant that does not build is reported, not fatal
                row.append(f"{name} failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
        setattr(module, KERNEL_NAME[module], original)
        print(f"{label}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
