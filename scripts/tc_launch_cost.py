"""CPU cost of one eager launch of the tensor-core conv, pointer vs TMA kernel (B=1 32^2: the GPU part is ~4 us)."""
import time

import torch

from taesd_fast.kernels import conv_tc as tc

x = torch.randn(1, 64, 32, 32, device="cuda").half().contiguous(memory_format=torch.channels_last)
w = torch.randn(64, 64, 3, 3, device="cuda").half() / 24
b = torch.randn(64, device="cuda").half()
for name, cfg in [("pointer", tc.TCConfig(64, 4, 3)), ("tma", tc.TCConfig(64, 4, 3, tile_w=8))]:
    for _ in range(20):
        tc.conv3x3_tc_launch(x, w, b, None, 1, True, config=cfg)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(500):
        tc.conv3x3_tc_launch(x, w, b, None, 1, True, config=cfg)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 500 * 1e6:.1f} us per eager launch (CPU-bound)")
