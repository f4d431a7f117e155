"""Benchmark section: whole TAESD encode/decode against the PyTorch baselines of ANCHORS.md, in one run.

Rows: eager NCHW, eager channels_last, channels_last + CUDA graph, torch.compile max-autotune (for the
workloads in MAX_AUTOTUNE), taesd_fast in auto mode (eager, and in a CUDA graph), and a plain default
`taesd.decode(x)` / `encode(x)` call (from its 3rd call on: a replay of the graph TAESD captured on the 2nd).
Random weights with the TAESD architecture (speed does not depend on the values); random inputs, never zeros.
"""

from __future__ import annotations

import copy

import torch

from ...graphs import graphed
from ...timing import time_ms

# (name, part, batch, height, width): height/width are image pixels.
WORKLOADS = [  # the ones compared with torch.compile first: a time-limited run still yields the key ratios
    ("decode 256² B=64", "decoder", 64, 256, 256),
    ("decode 256² B=1", "decoder", 1, 256, 256),
    ("encode 256² B=16", "encoder", 16, 256, 256),
    ("decode 256² B=16", "decoder", 16, 256, 256),
    ("decode 512² B=1", "decoder", 1, 512, 512),
    ("encode 512² B=1", "encoder", 1, 512, 512),
    ("decode 1024² B=1", "decoder", 1, 1024, 1024),
]
# max-autotune compiles for minutes per shape: only the issue-5 workloads (ANCHORS.md's three, and encode B=16).
MAX_AUTOTUNE = {"decode 256² B=1", "decode 256² B=64", "decode 1024² B=1", "encode 256² B=16"}


def _inputs(model, part: str, batch: int, h: int, w: int) -> torch.Tensor:
    if part == "decoder":
        f = model.downscale
        return torch.randn(batch, model.latent_channels, h // f, w // f, device="cuda", dtype=torch.float16)
    return torch.rand(batch, 3, h, w, device="cuda", dtype=torch.float16)


def bench_taesd(variant: str = "taesd", workloads=None, compile_modes=("max-autotune",)) -> list[dict]:
    """Rows of {workload, method, ms, vs_compile} for each workload and method."""
    from ... import backend
    from ...models.taesd.model import TAESD

    torch.backends.cudnn.benchmark = True
    model = TAESD(variant).cuda().half().eval()
    rows = []
    for name, part, batch, h, w in workloads or WORKLOADS:
        x = _inputs(model, part, batch, h, w)
        api = model.decode if part == "decoder" else model.encode
        # Baselines: copies of the bare nn.Sequential run with backend("torch") (F.conv2d per conv), in the
        # layout the row names. taesd_fast itself keeps conv weights channels_last on CUDA.
        plain = copy.deepcopy(getattr(model, part)).to(memory_format=torch.contiguous_format)
        cl = copy.deepcopy(plain).to(memory_format=torch.channels_last)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        methods = {}
        with torch.no_grad(), backend("torch"):
            methods["eager NCHW"] = lambda: plain(x)
            methods["eager channels_last"] = lambda: cl(x_cl)
            times = {k: time_ms(f) for k, f in methods.items()}
            times["channels_last + CUDA graph"] = time_ms(graphed(lambda: cl(x_cl)))
            for mode in compile_modes:
                if name not in MAX_AUTOTUNE:
                    continue
                torch._dynamo.reset()
                compiled = torch.compile(copy.deepcopy(cl), mode=mode)
                times[f"torch.compile {mode}"] = time_ms(lambda: compiled(x_cl))
        with torch.no_grad(), backend("auto"):
            model.cuda_graphs = False  # eager: every call launches its kernels
            api(x)  # first call measures and records the per-layer choices
            times["taesd_fast auto"] = time_ms(lambda: api(x))
            times["taesd_fast auto + CUDA graph"] = time_ms(graphed(lambda: api(x)))
            # What a plain `taesd.decode(x)` costs by default: a replay of the graph captured on its 2nd call,
            # plus copying x in and the result out.
            model.cuda_graphs = True
            api(x), api(x)
            times["taesd_fast default call"] = time_ms(lambda: api(x))
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()), flush=True)
        best_compile = min((t for k, t in times.items() if k.startswith("torch.compile")), default=None)
        for method, ms in times.items():
            rows.append({
                "workload": name, "method": method, "ms": ms,
                "fps": batch * 1000.0 / ms,
                "vs_compile": (best_compile / ms) if best_compile else None,
            })
    return rows
