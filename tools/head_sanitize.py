"""Launch each head kernel on small odd shapes, for compute-sanitizer (memcheck / racecheck).

HEAD_SANITIZE_LIGHT=1 skips the fp32 cuDNN references (racecheck once crashed inside cuDNN's fp32 conv).
"""
import os

import torch
import torch.nn.functional as F

from taesd_fast.kernels import head as hk

light = os.environ.get("HEAD_SANITIZE_LIGHT") == "1"
torch.manual_seed(0)
x = F.silu(torch.randn(2, 256, 6, 13, 21, device="cuda")).bfloat16()
for layout in ("ncdhw", "cl3d"):  # GEMM form + pixel-major g / cuDNN form + dense g
    xl = x.contiguous(memory_format=torch.channels_last_3d) if layout == "cl3d" else x
    for c_out in (12, 3):  # 3: the scalar (non-vector) load path
        w = (torch.randn(c_out, 256, 3, 3, 3, device="cuda") * 0.02).bfloat16()
        b = (torch.randn(c_out, device="cuda") * 0.1).bfloat16()
        out = hk.split_head_conv(xl, w, b)  # full frame
        band = hk.split_head_conv(xl, w, b, band_rows=4)  # banded: clipped halos at both borders
        torch.cuda.synchronize()
        msg = f"{layout} C_out={c_out} band max diff {(band.float() - out.float()).abs().max().item()}"
        if not light:
            g32 = hk.conv_n128_ref(x.float(), hk.pack_weight(w))
            o32 = hk.head_stencil(g32, b.float(), 4, 0, 13, 13, 0)  # f32 g
            ref = F.conv3d(x.float(), w.float(), b.float(), padding=(0, 1, 1)).clamp(-1, 1)
            torch.cuda.synchronize()
            msg += (f" rel err {((out.float() - ref).norm() / ref.norm()).item():.3e}"
                    f" f32-g err {((o32.float() - ref).norm() / ref.norm()).item():.3e}")
        print(msg)
print("sanitize script done")
