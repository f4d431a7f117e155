"""Launch every conv3x3_f16 variant on small odd shapes, with and without the optional bias/residual
(null pointers), for compute-sanitizer memcheck/racecheck."""
import torch

from taesd_fast.kernels import conv3x3

op = torch.ops.taesd_fast.conv3x3_f16
g = torch.Generator(device="cuda").manual_seed(0)
for cin, cout, H, W in [(64, 64, 19, 21), (3, 64, 17, 9), (64, 3, 5, 33), (1, 1, 1, 1)]:
    for stride in (1, 2):
        for optional in (True, False):
            x = torch.randn(2, cin, H, W, device="cuda", generator=g).half()
            w = torch.randn(cout, cin, 3, 3, device="cuda", generator=g).half()
            b = torch.randn(cout, device="cuda", generator=g).half() if optional else None
            shape = (2, cout, (H - 1) // stride + 1, (W - 1) // stride + 1)
            r = torch.randn(shape, device="cuda", generator=g).half() if optional else None
            ref = conv3x3.conv3x3_f16_ref(x, w, b, r, stride, optional)
            for v in conv3x3.VARIANTS:
                if v == "rb" and stride == 2:
                    continue
                y = op(x, w, b, r, stride, optional, v)
                torch.cuda.synchronize()
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                print(f"{v} {cin}->{cout} s{stride} {H}x{W} bias/res={optional}: rel err vs twin {err:.2e}")
print("sanitize script done")
