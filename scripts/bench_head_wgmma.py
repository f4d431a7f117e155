"""The Hopper head g kernels (CUDA C++: kernels/head_cuda.py; Gluon: kernels/head_wgmma.py) against the Triton one,
side by side, at the Wan chunk size
(B=1, C=256, T=4 + 2 cached frames, 352x640, bf16), each as a CUDA-graph replay; plus the whole OutputHead call
and the error of each path against an fp32 reference. Run: python3 scripts/bench_head_wgmma.py [--t 4 --h 352 ...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from taesd_fast import OutputHead, dispatch
from taesd_fast.bench_head import head_diffusers
from taesd_fast.kernels import head_fused as hf
from taesd_fast.kernels import head_cuda, head_wgmma
from taesd_fast.timing import graphed, time_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=4)
    ap.add_argument("--h", type=int, default=352)
    ap.add_argument("--w", type=int, default=640)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the diffusers head")
    args = ap.parse_args()
    b, c, t, h, w = args.b, 256, args.t, args.h, args.w
    torch.manual_seed(0)
    feat = torch.randn(b, c, t, h, w, device="cuda").bfloat16()
    cache = F.silu(torch.randn(b, c, 2, h, w, device="cuda")).bfloat16()
    gamma = (1 + 0.1 * torch.randn(c, 1, 1, 1, device="cuda")).bfloat16()
    weight = (torch.randn(12, c, 3, 3, 3, device="cuda") * (0.6 / (27 * c) ** 0.5)).bfloat16()
    bias = (torch.randn(12, device="cuda") * 0.1).bfloat16()
    eps, scale = 1e-12, c**0.5
    gb_in = (feat.numel() + cache.numel()) * 2 / 1e9
    print(f"B={b} C={c} T={t} + 2 cached, {h}x{w}: {gb_in * 1e3:.0f} MB in "
          f"(read once at 4.24 TB/s: {gb_in / 4.24:.3f} ms)")

    with torch.no_grad():
        ref = head_diffusers(feat.float(), cache.float(), gamma.float(), weight.float(), bias.float())
        torch_bf16 = head_diffusers(feat, cache, gamma, weight, bias)
    rel = lambda out: ((out.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    print(f"error vs fp32: PyTorch bf16 {rel(torch_bf16):.3e}")

    rows = []
    for name, cfg in (("CUDA C++ g kernel + stencil", {"variant": "cuda_sm90"}),
                      ("Gluon wgmma g kernel + stencil", {"variant": "wgmma"}),
                      ("Triton roll g kernel + stencil", {"variant": "roll"})):
        fn = lambda cfg=cfg: hf.fused_head_with(feat, cache, gamma, weight, bias, eps, scale, cfg)  # noqa: E731
        out = fn()[0]
        rows.append((name, time_ms(graphed(fn)), f"rel err {rel(out):.3e}"))

    # The g kernel alone (outputs allocated once, outside the graph).
    wt = hf.pack_weight_taps_t(weight)
    gs = hf.scaled_gamma(gamma, scale)
    g = feat.new_empty((b, t, h, w, hf.GC))
    new_cache = feat.new_empty((b, c, 2, h, w))
    moved = gb_in + new_cache.numel() * 2 / 1e9 + g.numel() * 2 / 1e9
    outs = {}
    for name, kernel in (("CUDA C++", head_cuda), ("Gluon", head_wgmma)):
        ms = time_ms(graphed(lambda kernel=kernel: kernel.launch(feat, cache, gs, wt, g, new_cache, eps)))
        rows.append((f"part: {name} g kernel alone", ms, f"{moved * 1e3:.0f} MB moved: {moved / ms:.2f} TB/s"))
        outs[name] = (g.clone(), new_cache.clone())
    (g1, c1), (g2, c2) = outs.values()
    print(f"CUDA vs Gluon: g max |diff| {(g1.float() - g2.float()).abs().max().item():.3e} "
          f"({(g1 != g2).float().mean().item():.2e} of elements differ); new cache equal: {torch.equal(c1, c2)}")

    head = OutputHead(c, 12).cuda().bfloat16()
    with torch.no_grad():
        head.norm_out.gamma.copy_(gamma)
        head.conv_out.weight.copy_(weight)
        head.conv_out.bias.copy_(bias)
        with dispatch.backend("auto"):
            head(feat, cache)
            choice = head.dispatch_table().splitlines()[-1]
            rows.append(("OutputHead.forward, auto, eager", time_ms(lambda: head(feat, cache)), ""))
            rows.append(("OutputHead.forward, auto, CUDA graph", time_ms(graphed(lambda: head(feat, cache))), ""))
        if args.compile:
            hc = torch.compile(head_diffusers, mode="max-autotune")
            rows.append(("diffusers head, torch.compile max-autotune",
                         time_ms(lambda: hc(feat, cache, gamma, weight, bias)), ""))
    for name, ms, note in rows:
        print(f"{name:48s} {ms:8.4f} ms  {note}")
    print("dispatch:", choice)


if __name__ == "__main__":
    main()
