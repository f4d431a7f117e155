"""Every SIMT f16 direct conv variant (taesd_fast::conv3x3_f16, csrc/conv3x3_f16.cu: "tile", "ocb4", "rb") on small
odd shapes, stride 1 and 2, with the optional bias / residual (null pointers when absent) and ReLU on and off, for
compute-sanitizer memcheck / racecheck (tools/sanitize.sh).

    python3 tools/conv_sanitize.py

Outputs are NaN-poisoned; each launch prints its relative error against the float64 maths next to PyTorch's own f16
error on the CPU (the bound is 2x that). Exits 1 if any launch failed; ends with "sanitize script done".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kernel_checks import Tally, poisoned, rel_err

from taesd_fast.kernels import simt_conv, conv_contract

SHAPES = [(64, 64, 19, 21), (3, 64, 17, 9), (64, 3, 5, 33), (1, 1, 1, 1)]  # C_in, C_out, H, W


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    op = torch.ops.taesd_fast.conv3x3_f16  # registered by importing simt_conv
    g = torch.Generator(device="cuda").manual_seed(0)
    tally = Tally()
    for cin, cout, H, W in SHAPES:
        for stride in (1, 2):
            for optional in (True, False):
                x = torch.randn(2, cin, H, W, device="cuda", generator=g).half()
                w = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (3 * cin**0.5)).half()
                b = torch.randn(cout, device="cuda", generator=g).half() if optional else None
                shape = conv_contract.output_shape(x.shape, w.shape, stride)
                r = torch.randn(shape, device="cuda", generator=g).half() if optional else None
                cpu = [None if t is None else t.cpu() for t in (x, w, b, r)]
                ref = conv_contract.conv3x3_math(*cpu, stride, optional, dtype=torch.float64)
                torch_err = rel_err(conv_contract.conv3x3_math(*cpu, stride, optional), ref)
                for variant in simt_conv.VARIANTS:
                    if simt_conv.unsupported_reason(x.shape, w.shape, x.dtype, stride, variant) is not None:
                        continue  # "rb" is stride 1 only
                    what = f"{cin}->{cout} s{stride} {H}x{W} bias/res/relu={optional}"
                    try:
                        with poisoned():
                            y = op(x, w, b, r, stride, optional, variant)
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 - report every variant, not just the first that breaks
                        tally.fail(f"conv3x3_f16 {variant}", what, f"{type(e).__name__}: {e}")
                        continue
                    tally.check(f"conv3x3_f16 {variant}", what, y, ref, torch_err)
    return tally.exit_code()


if __name__ == "__main__":
    sys.exit(main())
