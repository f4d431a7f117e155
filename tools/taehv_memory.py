#!/usr/bin/env python3
"""Peak GPU memory and time of TAEHV `decode_video` as the clip grows, and against the chunk budget.

    python3 tools/taehv_memory.py [--variant taew2_2] [--latents 31,61,121] [--size 704x1280]
        [--budgets-gib 0.5,1,1.5,3,inf] [--uint8]

For each latent count: the user's call `model.decode_video(z)` (fp16, default chunk_bytes) with its ms (median),
whether it is replayed as a whole-call CUDA graph (TAEHV.cuda_graphs: where the frames take at most half the
budget) or eager, peak GB (torch.cuda.max_memory_allocated over the timed calls, the model and latents included;
and over the second call, which captures the graph), the output's GB and the chunk lengths (latent frames per
chunk of the low-resolution layers / frames per chunk of the last stage). Tuning is blocking (the timings are
those of the tuned rows).
Then, for the first latent count, the same at each chunk budget (TAEHV.chunk_bytes; inf is one chunk, the whole
video at once), so the default's memory/speed trade-off can be read off. Random weights in the
published layout. With $OUT set the table is also written to $OUT/taehv_memory.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import dispatch
from taesd_fast.apps.bench.taehv import random_decoder
from taesd_fast.models.taehv.model import CHUNK_BYTES
from taesd_fast.timing import time_ms


def measure(model, z: torch.Tensor, uint8: bool) -> dict:
    """ms, peak GB (steady state, and of the second call, which captures the whole-call CUDA graph where the model
    replays one), output GB, chunk lengths and whether the call is replayed, of model.decode_video(z) at the model's
    chunk_bytes."""
    for cache in model._graph_caches.values():  # an earlier row's graph would hold its memory through this row
        cache.clear()
    gc.collect()
    torch.cuda.empty_cache()
    param = next(model.decoder.parameters())
    outer, inner, _ = model._decode_chunks(z.shape[1], z.shape[-2], z.shape[-1], param)
    chunk = f"{outer} latents / {inner} frames"
    with torch.no_grad():
        out = model.decode_video(z, uint8=uint8)  # first call: eager (the tuning process gets its shapes)
        out_gb = out.numel() * out.element_size() / 1e9
        replayed = model._whole_call_graph(out.numel() * out.element_size(), False)
        del out
        gc.collect()
        peaks = []
        for fn in (lambda: model.decode_video(z, uint8=uint8),  # the second call (the capture, where replayed)
                   lambda: time_ms(lambda: model.decode_video(z, uint8=uint8), reps=3)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = fn()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 1e9)
    return {"ms": ms, "peak GB": peaks[1], "second call GB": peaks[0], "output GB": out_gb, "chunk": chunk,
            "graph": "replay" if replayed else "eager"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="taew2_2")
    ap.add_argument("--latents", default="31,61,121", help="comma-separated latent frame counts")
    ap.add_argument("--size", default="704x1280", help="output HEIGHTxWIDTH in pixels")
    ap.add_argument("--budgets-gib", default="0.5,1,1.5,3,inf", help="chunk budgets to sweep (GiB; inf: whole)")
    ap.add_argument("--uint8", action="store_true", help="uint8 frames (the video writer's output)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"error: this measures GPU memory, and torch {torch.__version__} sees no CUDA GPU")
    h, w = (int(v) for v in args.size.lower().split("x"))
    dispatch.set_tuning("blocking")
    model = random_decoder(args.variant).cuda().half()
    side = model.space_upscale
    counts = [int(v) for v in args.latents.split(",")]
    lines = [f"TAEHV {args.variant} decode_video at {h}x{w}, fp16{' uint8 output' if args.uint8 else ''}", "",
             "| latents | frames | chunk budget GiB | chunk | call | ms | peak GB | second call peak GB | output GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    runs = [(t, CHUNK_BYTES) for t in counts]
    runs += [(counts[0], float(b) * 2**30) for b in args.budgets_gib.split(",")]
    for t, budget in runs:
        z = torch.randn(1, t, model.latent_channels, h // side, w // side, device="cuda", dtype=torch.float16)
        model.chunk_bytes = budget
        try:
            r = measure(model, z, args.uint8)
            row = (f"| {t} | {model.t_upscale * t - model.frames_to_trim} | {budget / 2**30:g} | {r['chunk']} | "
                   f"{r['graph']} | {r['ms']:.2f} | {r['peak GB']:.2f} | {r['second call GB']:.2f} | "
                   f"{r['output GB']:.2f} |")
        except torch.cuda.OutOfMemoryError:
            row = f"| {t} | | {budget / 2**30:g} | | | out of memory | | | |"
        del z
        lines.append(row)
        print(row, flush=True)
    model.chunk_bytes = CHUNK_BYTES
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "taehv_memory.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
