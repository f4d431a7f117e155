"""Launch the Triton and Gluon kernels (tensor-core conv incl. its TMA, row-streaming, small-tile and upsample variants, fused head with its
Triton and Hopper g kernels, norm+SiLU window)
on small odd shapes with every optional operand on and off, for compute-sanitizer memcheck/racecheck. Prints the error
vs each PyTorch twin. `--head-only`: just the head kernels; `--conv-only`: just the convs; `--latency-only`: just
the latency convs (conv_tile, conv_up, conv_narrow: the small_tile configs)."""
import sys

import torch

from taesd_fast.kernels import conv_halo, conv_tc, head_act, head_fused
from taesd_fast.kernels import head as hk

g = torch.Generator(device="cuda").manual_seed(0)
rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
LATENCY_ONLY = "--latency-only" in sys.argv
CONV_CASES = [] if "--head-only" in sys.argv else [
    (64, 64, 19, 21, 1, 1, False), (64, 64, 19, 21, 2, 1, False), (64, 64, 9, 11, 1, 2, False),
    (3, 64, 17, 9, 1, 1, False), (4, 64, 7, 5, 1, 1, True), (64, 3, 5, 33, 1, 1, False),
    (64, 64, 7, 70, 1, 1, False), (64, 3, 5, 130, 1, 1, False), (64, 64, 9, 20, 1, 1, False),
    (64, 64, 70, 70, 1, 1, False),  # the last two: the small-tile kernel with half the channels, with two-row tiles
    (64, 64, 60, 70, 1, 2, False)]  # the upsample kernel with 4-row tiles and a partial strip (up2 cases, opt=False)
for cin, cout, H, W, stride, up, clamp in CONV_CASES:
    for optional in (True, False):
        x = rnd(2, cin, H, W).half().contiguous(memory_format=torch.channels_last)
        w = (rnd(cout, cin, 3, 3) / (9 * cin) ** 0.5).half()
        b = rnd(cout).half() if optional else None
        shape = conv_tc.output_shape(x.shape, w.shape, stride, up)
        r = rnd(*shape).half().contiguous(memory_format=torch.channels_last) if optional else None
        ref = conv_tc.conv3x3_tc_ref(x, w, b, r, stride, optional, up, clamp)
        tma_ok = stride == 1 and not clamp and cin >= 16  # the TMA variant's cases (tile_w configs)
        halo_ok = tma_ok and up == 1 and cin == 64 and W >= 64  # the row-streaming kernel's cases (halo_w configs)
        small = [conv_tc.TCConfig(64, 4, 3, small_tile=True)] if tma_ok and cin == cout == 64 else []
        tma = [conv_tc.TCConfig(64, 4, 3, tile_w=8), conv_tc.TCConfig(128, 4, 3, tile_w=16, persistent=2)]
        halo = [conv_tc.TCConfig(128, 4, 3, tile_w=16, halo_w=64)]
        cfgs = small if LATENCY_ONLY else [None] + (tma if tma_ok else []) + (halo if halo_ok else []) + small
        for cfg in cfgs:
            rows_per_program = conv_halo._rows_per_program
            if cfg is not None and cfg.halo_w:  # short row chunks: every program re-reads halo rows at both ends
                conv_halo._rows_per_program = lambda *a: 2
            y = conv_tc.conv3x3_tc_launch(x, w, b, r, stride, optional, up, clamp, config=cfg)
            torch.cuda.synchronize()
            conv_halo._rows_per_program = rows_per_program
            print(f"tc {cfg or 'default'} {cin}->{cout} s{stride} up{up} clamp={clamp} {H}x{W} opt={optional}: "
                  f"rel err {rel(y, ref):.2e}")
# The narrow-output latency kernel (conv_narrow: 64 -> 3, 4 or 7, no residual), bias and ReLU on and off, with 1, 2
# and 4 rows per program and rows narrower than the tile (the last: the encoder's 64->4 at 32^2, B=16).
for cout, B, H, W in ([] if "--head-only" in sys.argv else [(3, 2, 5, 33), (7, 1, 200, 130), (3, 1, 300, 64),
                                                              (4, 16, 32, 32)]):
    for optional in (True, False):
        x = rnd(B, 64, H, W).half().contiguous(memory_format=torch.channels_last)
        w = (rnd(cout, 64, 3, 3) / 24).half()
        b = rnd(cout).half() if optional else None
        ref = conv_tc.conv3x3_tc_ref(x, w, b, None, 1, optional)
        y = conv_tc.conv3x3_tc_launch(x, w, b, None, 1, optional, config=conv_tc.TCConfig(64, 4, 3, small_tile=True))
        torch.cuda.synchronize()
        print(f"narrow 64->{cout} {B}x{H}x{W} opt={optional}: rel err {rel(y, ref):.2e}")
# (T, cache, H, W): odd sizes take the Triton head kernel; H*W multiples of 8 the CUDA one on sm_90 (64x136: more
# 64-pixel tiles than SMs, so programs walk two tiles and the TMA ring wraps across them).
HEAD_CASES = [] if "--conv-only" in sys.argv or LATENCY_ONLY else [(1, False, 13, 21), (3, True, 13, 21), (1, False, 16, 40),
                                                   (4, True, 64, 136), (2, True, 12, 20)]
for t, with_cache, h, w_ in HEAD_CASES:
    c = 256
    x = rnd(1, c, t, h, w_).bfloat16()
    cache = torch.nn.functional.silu(rnd(1, c, 2, h, w_)).bfloat16() if with_cache else None
    gamma = (1 + 0.1 * rnd(c, 1, 1, 1)).bfloat16()
    wt = (rnd(12, c, 3, 3, 3) * (0.6 / (27 * c) ** 0.5)).bfloat16()
    bias = (0.1 * rnd(12)).bfloat16()
    ref = hk.causal_window(hk.activate(x, gamma, 1e-12), cache)
    win = head_act.activated_window(x, cache, gamma, 1e-12)
    variant = head_fused._variant("auto", x, cache)
    out, new_cache = head_fused.fused_head(x, cache, gamma, wt, bias, 1e-12, c**0.5)
    video, _ = head_fused.fused_head(x, cache, gamma, wt, bias, 1e-12, c**0.5, 2)  # the stencil writing the video
    torch.cuda.synchronize()
    conv_ref = torch.nn.functional.conv3d(ref.float(), wt.float(), bias.float(), padding=(0, 1, 1)).clamp(-1, 1)
    print(f"head T={t} cache={with_cache} {h}x{w_}: window rel err {rel(win, ref):.2e}, fused head ({variant}) rel "
          f"err {rel(out, conv_ref):.2e}, new cache rel err {rel(new_cache, ref[:, :, -2:]):.2e}, video rel err "
          f"{rel(video, hk.unpatchify(conv_ref, 2)):.2e}")
print("sanitize script done")
