#!/usr/bin/env python3
"""The fused decoder tail (kernels/cuda_tail.py) against the unfused one (triton_conv_tma.grow_launch, then
gluon_conv_rows' 64 -> 3 p^2 conv, then triton_frames), and TAEHV.fused_tail off / on in the user's calls.

    python3 tools/bench_tail.py kernels                      # chains of 20 graph-replayed launches, µs per tail
    python3 tools/bench_tail.py model taew2_1 320x512        # the uint8 step and a 16-latent decode_video

`kernels` runs taew2_1's step shape and a decode chunk, with the uint8 frames of both paths compared. `model` tunes (blocking) with a random
decoder in the published layout, then alternates the two settings in one process: 5 rounds of 60 steps and 5
decode_video calls each, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast import dispatch, timing  # noqa: E402
from taesd_fast.kernels import cuda_tail, gluon_conv_rows, triton_conv_tma  # noqa: E402
from taesd_fast.kernels.triton_frames import write_frames  # noqa: E402

CL = torch.channels_last


def graph_us(fn, n=20, reps=5):
    replay = timing.capture_calls(fn, n, warmup=2)
    best = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timing.busy_gpu()
        s.record()
        replay()
        e.record()
        e.synchronize()
        best.append(s.elapsed_time(e) * 1e3 / n)
    return min(best)


def kernels():
    for name, (N, H, W) in {"taew2_1 step": (2, 160, 256), "taew2_1 decode chunk": (8, 160, 256)}.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, 64, H, W, generator=g, device="cuda").half().contiguous(memory_format=CL)
        gw = (torch.randn(128, 64, 1, 1, generator=g, device="cuda") / 8).half()
        w = (torch.randn(64, 64, 3, 3, generator=g, device="cuda") / 24).half()
        w2 = (torch.randn(3, 64, 3, 3, generator=g, device="cuda") / 24).half()
        b2 = (torch.randn(3, generator=g, device="cuda") * 0.3 + 0.5).half()
        into = torch.empty(1, 2 * N, 3, 2 * H, 2 * W, device="cuda", dtype=torch.uint8)
        into2 = torch.empty_like(into)

        def unfused():
            h = triton_conv_tma.grow_launch(x, gw, w, None, 2, True, 2)
            y = gluon_conv_rows.launch_conv(h, w2, b2, None, 1, False)
            write_frames(y, into, 1)

        def fused():
            cuda_tail.launch(x, gw, w, None, w2, b2, into2, pdl=True)

        unfused(), fused()
        torch.cuda.synchronize()
        diff = (into.int() - into2.int()).abs().max().item()
        t_unfused, t_fused = graph_us(unfused), graph_us(fused)
        t_up = graph_us(lambda: triton_conv_tma.grow_launch(x, gw, w, None, 2, True, 2))
        print(f"{name}: unfused {t_unfused:.1f} us (up conv alone {t_up:.1f}); fused {t_fused:.1f} us "
              f"({t_unfused / t_fused:.2f}x, uint8 max diff {diff})")

def model(variant, size):
    from taesd_fast.apps.bench.taehv import random_decoder
    m = random_decoder(variant).cuda().half()
    side = m.space_upscale
    z = torch.randn(1, 1, m.latent_channels, size[0] // side, size[1] // side, device="cuda", dtype=torch.half)
    zv = torch.randn(1, 16, m.latent_channels, size[0] // side, size[1] // side, device="cuda", dtype=torch.half)
    st = {"s": None}

    def step():
        f, st["s"] = m.decode_step(z, st["s"], uint8=True)
        return f

    with torch.no_grad(), dispatch.tuning("blocking"):
        for fused in (False, True):
            m.fused_tail = fused
            for _ in range(5):
                step()
            m.decode_video(zv, uint8=True), m.decode_video(zv, uint8=True)
        m.fused_tail = False
        a = m.decode_video(zv, uint8=True)
        m.fused_tail = True
        b = m.decode_video(zv, uint8=True)
        print(f"decode_video uint8 fused vs not: max diff {(a.int() - b.int()).abs().max().item()}")
        res = {False: ([], []), True: ([], [])}
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for r in range(5):
            for fused in (False, True):
                m.fused_tail = fused
                st["s"] = None
                for _ in range(4):
                    step()
                m.decode_video(zv, uint8=True)
                torch.cuda.synchronize()
                ev[0].record()
                for _ in range(60):
                    step()
                ev[1].record()
                ev[1].synchronize()
                res[fused][0].append(ev[0].elapsed_time(ev[1]) / 60)
                ev[0].record()
                for _ in range(5):
                    m.decode_video(zv, uint8=True)
                ev[1].record()
                ev[1].synchronize()
                res[fused][1].append(ev[0].elapsed_time(ev[1]) / 5)
        for fused, (ts, tv) in res.items():
            rounds = " ".join(f"{t:.4f}" for t in ts)
            print(f"{variant} fused_tail={fused}: step {statistics.median(ts):.4f} ms ({rounds}), "
                  f"16-latent decode_video {statistics.median(tv):.3f} ms")


def _size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("what", choices=("kernels", "model"))
    ap.add_argument("variant", nargs="?", default="taew2_1", help="with model: the TAEHV variant")
    ap.add_argument("size", nargs="?", type=_size, default=(320, 512), help="with model: HEIGHTxWIDTH in pixels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.what == "kernels":
        kernels()
    else:
        model(args.variant, args.size)


if __name__ == "__main__":
    main()
