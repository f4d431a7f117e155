#!/usr/bin/env python3
"""Which rows a TAEHV streaming step should run, measured in the user's own step.

The tuner's graph decisions swapped one at a time, each measured in the uint8 `decode_step` of one latent frame (a
graph replay), and `decide.CHAIN_PREFERRED` off against on.

    python3 tools/step_swaps.py [--variant taew2_1] [--size 320x512] [--slack 0.12] [--rounds 4] [--steps 60]

The tuner times each row as a replay of its own launches; in the step's graph, rows follow other kernels, and a row
may cost more or less there (BENCHMARKS.md, twenty-third session). After blocking tuning, every graph decision with
another kernel row timed within --slack of its choice gets a variant with that one decision replaced (all calls of
its shape); the rule's variant re-decides every call from the same stored timings without CHAIN_PREFERRED. Each
variant's step is captured anew (the dispatch generation moves), and the variants alternate in one process: --rounds
rounds of --steps steps, medians. Random weights in the published layout (the time does not depend on them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast import dispatch  # noqa: E402
from taesd_fast.apps.bench.taehv import random_decoder  # noqa: E402
from taesd_fast.dispatch import decide, table  # noqa: E402


def _size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    if not (h.isdigit() and w.isdigit()):
        raise argparse.ArgumentTypeError(f"--size takes HEIGHTxWIDTH in pixels (e.g. 320x512), got {text!r}")
    return int(h), int(w)


def _label(rec) -> str:
    s = rec.spec
    flags = "".join(f for f, on in (("b", s.bias), ("r", s.residual), ("R", s.relu)) if on) or "-"
    return f"{s.kind} {'x'.join(map(str, s.x_shape))} -> {s.w_shape[0]} ch, {flags}"


def variants(base: dict, slack: float) -> dict[str, dict]:
    """name -> the decisions to run: the tuner's, each single swap within `slack`, and the rule off."""
    out = {"tuner's decisions": base}
    for key, rec in base.items():
        if not key[1]:  # eager decisions: a step replays graph decisions only
            continue
        best = rec.ms.get(rec.choice)
        for name, ms in sorted(rec.ms.items(), key=lambda kv: kv[1]):
            if name in (rec.choice, table.reference(rec.spec.kind).name) or best is None or ms > best * (1 + slack):
                continue
            swapped = dict(base)
            swapped[key] = decide.Record(rec.spec, name, "swapped", rec.ms, rec.skipped,
                                         table.row(rec.spec.kind, name).run)
            out[f"{_label(rec)}: {rec.choice} {best * 1e3:.2f} -> {name} {ms * 1e3:.2f} µs"] = swapped
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="taew2_1")
    ap.add_argument("--size", type=_size, default=(320, 512), help="output HEIGHTxWIDTH in pixels")
    ap.add_argument("--slack", type=float, default=0.12, help="swap to rows timed within this fraction of the choice")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    model = random_decoder(args.variant).cuda().half()
    side = model.space_upscale
    z = torch.randn(1, 1, model.latent_channels, args.size[0] // side, args.size[1] // side, device="cuda",
                    dtype=torch.half)
    stream = {"state": None}

    def step():
        frames, stream["state"] = model.decode_step(z, stream["state"], uint8=True)
        return frames

    with torch.no_grad(), dispatch.tuning("blocking"):
        for _ in range(6):  # eager, capture, and captures again where tuning changed decisions
            step()
        torch.cuda.synchronize()
        base = dict(decide.state.decided)
        runs = variants(base, args.slack)
        rule = decide.CHAIN_PREFERRED
        runs["CHAIN_PREFERRED off"] = None  # re-decided from the stored timings below
        times: dict[str, list] = {name: [] for name in runs}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            for _ in range(args.rounds):
                for name, decided in runs.items():
                    decide.state.decided.clear()
                    if decided is None:
                        decide.CHAIN_PREFERRED = ()
                    else:
                        decide.state.decided.update(decided)
                    decide.state.generation += 1  # the step's graph is stale: it captures again
                    for _ in range(4):
                        step()
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.steps):
                        step()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) / args.steps)
                    decide.CHAIN_PREFERRED = rule
        finally:
            decide.CHAIN_PREFERRED = rule
    first = statistics.median(times["tuner's decisions"])
    print(f"TAEHV {args.variant} uint8 decode_step at {args.size[0]}x{args.size[1]}: {args.rounds} alternating rounds "
          f"of {args.steps} steps, medians\n\n| variant | step ms | vs the tuner's |\n|---|---|---|")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"| {name} | {ms:.4f} | {ms / first:.3f} |")


if __name__ == "__main__":
    main()
