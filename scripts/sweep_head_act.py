"""Sweep the launch config of the Triton norm+SiLU window kernel (kernels/head_act.py) at the Wan chunk size
(features [1, 256, 4, 352, 640] + 2 cached frames, bf16), as CUDA-graph replays; every config's window must match
the default config's (up to rare 1-ulp flips). Prints ms and achieved bandwidth per config, best last."""
import itertools

import torch

from taesd_fast.kernels import head_act
from taesd_fast.timing import graphed, time_ms

torch.manual_seed(0)
x = torch.randn(1, 256, 4, 352, 640, device="cuda").bfloat16()
cache = torch.nn.functional.silu(torch.randn(1, 256, 2, 352, 640, device="cuda")).bfloat16()
gamma = (1 + 0.1 * torch.randn(256, 1, 1, 1, device="cuda")).bfloat16()
ref = head_act.activated_window(x, cache, gamma, 1e-12)
gb = (x.numel() * 2 + cache.numel() * 2 * 2) * 2 / 1e9  # features in + window out, cache in + out
rows = []
for bp, bk, nw in itertools.product((64, 128, 256, 512), (16, 32, 64), (4, 8)):
    try:
        fn = lambda: head_act.activated_window(x, cache, gamma, 1e-12, block_p=bp, bk=bk, num_warps=nw)  # noqa: E731
        # A different channel split sums the squares in another order: rare 1-ulp flips, never more.
        differing = (fn().float() - ref.float()).abs().gt(0).float().mean().item()
        assert differing <= 1e-3, f"{differing:.2e} of the window differs from the default config"
        ms = time_ms(graphed(fn))
        rows.append((ms, bp, bk, nw))
        print(f"block_p={bp:4d} bk={bk:3d} warps={nw}: {ms:.4f} ms  {gb / ms:.2f} TB/s", flush=True)
    except Exception as e:  # noqa: BLE001  a config that cannot compile or launch is just skipped
        print(f"block_p={bp} bk={bk} warps={nw}: failed {type(e).__name__}: {str(e)[:100]}")
copy = time_ms(graphed(lambda: ref.clone()))
print(f"floor: clone of the window {copy:.4f} ms")
ms, bp, bk, nw = min(rows)
print(f"best: block_p={bp} bk={bk} num_warps={nw}: {ms:.4f} ms ({gb / ms:.2f} TB/s)")
