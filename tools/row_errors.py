#!/usr/bin/env python3
"""Each dispatched call of a TAEHV decode, checked element by element: the chosen row's output against an fp32
reference of the same call on the same inputs, beside PyTorch fp16's own error there. A row whose worst element is
far off shows here even where the decode's overall (L2) error looks normal.

    python3 tools/row_errors.py [--variant taew2_1] [--latents 16] [--height 40] [--width 64] [--mode auto]
                                [--device cuda] [--top 25] [--poison] [--no-pdl] [--repeat 1]

The model has random weights in the published layout (the bench's `random_decoder`); mode auto tunes first
(blocking, timed as graph replays), so the rows are the ones a user's tuned decode runs (decode_video replays a
CUDA graph from its second call; here every call runs eagerly, with the replay's decisions, under the check). For every call: the row, the largest |out - ref|
and where it is (batch, channel, y, x), PyTorch fp16's largest error on that call, and their ratio. Then the whole
decode's largest error against the fp32 decode and the frame it is in. On the CPU every call runs PyTorch (a smoke
test of the tool itself). --poison NaN-fills the conv kernels' outputs before they run (an element a kernel never
writes shows as nan); --no-pdl launches without programmatic dependent launch; --repeat decodes that many times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import dispatch
from taesd_fast.apps.bench.taehv import random_decoder
from taesd_fast.dispatch import calls, decide, table


def _to(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _worst(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, tuple]:
    diff = (out.float() - ref).abs().nan_to_num(float("inf"))
    flat = int(diff.argmax())
    return float(diff.reshape(-1)[flat]), tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


class Spy:
    """Wraps calls._choose: each call also runs the kind's PyTorch row in fp32 and in the call's own dtype."""

    def __init__(self):
        self.records: list[dict] = []
        self.original = calls._choose

    def __enter__(self):
        def choose(key, args, layer):
            run = self.original(key, args, layer)

            def checked(*a):
                out = run(*a)
                ref_row = table.reference(key[0])
                ref = _first(ref_row.run(*(_to(v, torch.float32) for v in a))).float()
                low = _first(ref_row.run(*a))
                got = _first(out)
                err, where = _worst(got, ref)
                err_torch, _ = _worst(low, ref)
                rec = decide.state.decided.get((decide.state.mode, decide.state.graph, key))
                self.records.append({
                    "layer": getattr(layer, "layer_name", None) or type(layer).__name__,
                    "kind": key[0], "shape": tuple(got.shape), "row": rec.choice if rec else "?",
                    "err": err, "where": where, "err_torch": err_torch,
                    "ratio": err / max(err_torch, 1e-12)})
                return out
            return checked

        calls._choose = choose
        return self

    def __exit__(self, *exc):
        calls._choose = self.original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="taew2_1")
    ap.add_argument("--latents", type=int, default=16)
    ap.add_argument("--height", type=int, default=40, help="latent cells")
    ap.add_argument("--width", type=int, default=64, help="latent cells")
    ap.add_argument("--mode", default="auto", choices=("auto", "kernels", "torch"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--poison", action="store_true", help="NaN-fill the conv kernels' outputs before each launch")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--repeat", type=int, default=1, help="decodes under the check")
    args = ap.parse_args(argv)
    from taesd_fast.kernels import conv_contract, tma_pdl
    conv_contract.POISON_OUTPUT = args.poison
    tma_pdl.PDL = not args.no_pdl
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device} but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references, not TF32
    dtype = torch.float16 if cuda else torch.float32
    model32 = random_decoder(args.variant).to(args.device)
    model = random_decoder(args.variant).to(args.device, dtype)
    model.cuda_graphs = False  # the spy runs each call eagerly (with the decisions of graph replays, below)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(1, args.latents, model.latent_channels, args.height, args.width, generator=gen).to(args.device)
    with torch.no_grad():
        with dispatch.backend("torch"):
            ref = model32.decode_video(z)
        # The rows a user's decode_video runs: it is a CUDA-graph replay from its second call, so graph_timing.
        with dispatch.backend(args.mode), dispatch.tuning("blocking"), dispatch.graph_timing():
            model.decode_video(z.to(dtype))  # tunes (auto) or loads the kernels, outside the spy
            with Spy() as spy:
                for _ in range(args.repeat):
                    out = model.decode_video(z.to(dtype))
    recs = sorted(spy.records, key=lambda r: -r["ratio"])
    print(f"{len(recs)} dispatched calls, {args.variant} {args.latents} latents {args.height}x{args.width}, "
          f"mode {args.mode}, {str(dtype).replace('torch.', '')}; worst first")
    print("ratio | err | PyTorch err | row | layer | kind | out shape | where (b, c, y, x)")
    for r in recs[:args.top]:
        print(f"{r['ratio']:.2f} | {r['err']:.3g} | {r['err_torch']:.3g} | {r['row']} | {r['layer']} | {r['kind']} | "
              f"{r['shape']} | {r['where']}")
    by_row: dict[str, float] = {}
    for r in recs:
        by_row[r["row"]] = max(by_row.get(r["row"], 0.0), r["ratio"])
    print("worst ratio per row: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_row.items(), key=lambda kv: -kv[1])))
    err, where = _worst(out, ref)
    low_err, low_where = _worst(_decode_torch(model, z.to(dtype)), ref)
    print(f"decode: max abs err {err:.4g} at (b, t, c, y, x) {where}; PyTorch {str(dtype).replace('torch.', '')} "
          f"{low_err:.4g} at {low_where}")
    return 0


def _decode_torch(model, z):
    with torch.no_grad(), dispatch.backend("torch"):
        return model.decode_video(z)


if __name__ == "__main__":
    sys.exit(main())
