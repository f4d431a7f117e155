"""Where the CUDA head g kernel spends its time: variants of csrc/head_g_sm90.cu with parts removed (MMAs, the
activation, the g stores, the new cache's stores), timed alone as CUDA-graph replays at the Wan chunk size. A
diagnostic, not a test: the variants compute wrong g. Run: python3 scripts/head_cuda_probe.py [T] [name,name...]
"""

from __future__ import annotations

import sys

from kernel_variants import wan_head_chunk  # beside this script
from taesd_fast import _backend
from taesd_fast.kernels import head_cuda
from taesd_fast.timing import graphed, time_ms

NO_MMA = ("""    tap<R, 2>(m, acc, s, kc, a);
    tap<R, 1>(m, acc, s, kc, a);
    tap<R, 0>(m, acc, s, kc, a);
""", "")
NO_ACT = ("const bool cached = s < 2;", "const bool cached = true;")  # chunks copied on, not activated
NO_G = ("    store_g(m, acc[(R + 1) % 3], img, p0, s - 2);\n", "")
NO_CACHE_STORE = [("if (store && threadIdx.x % 128 == 0) tma_store_4d(", "if (false) tma_store_4d("),
                  ("m.pending_store = store;", "m.pending_store = false;")]
VARIANTS = {
    "baseline": [],
    "no MMA": [NO_MMA],
    "no activation": [NO_ACT],
    "no g store": [NO_G],
    "no cache store": NO_CACHE_STORE,
    "no MMA, no activation": [NO_MMA, NO_ACT],
    "loads only (no MMA, activation, stores)": [NO_MMA, NO_ACT, NO_G, *NO_CACHE_STORE],
}


def variant_source(name: str, edits) -> str:
    """Write the edited kernel source beside the real one (git-ignored) and return its name for head_cuda.launch."""
    src = (_backend._CSRC / head_cuda.SOURCE).read_text()
    for old, new in edits:
        assert old in src, (name, old[:60])
        src = src.replace(old, new)
    tag = "".join(ch if ch.isalnum() else "_" for ch in name)
    file = f"_probe_{tag}.cu"
    (_backend._CSRC / file).write_text(src)
    _backend.ARCH_SPECIFIC[file] = 90
    return file


def main() -> None:
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    x = wan_head_chunk(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    feat, cache, gs, wt, g, nc, c = x.feat, x.cache, x.gs, x.wt, x.g, x.nc, x.feat.shape[1]
    files = []
    try:
        for name, edits in VARIANTS.items():
            if only and not any(o in name for o in only):
                continue
            files.append(variant_source(name, edits))
            fn = lambda src=files[-1]: head_cuda.launch(feat, cache, gs, wt, g, nc, 1e-12, source=src)  # noqa: E731
            print(f"{name:42s} {time_ms(graphed(fn)):8.4f} ms", flush=True)
        if only is None or "slots" in only:  # the ring's depth: one slot fewer than fits
            real = head_cuda._slots
            head_cuda._slots = lambda c: real(c) - 1
            try:
                fn = lambda: head_cuda.launch(feat, cache, gs, wt, g, nc, 1e-12)  # noqa: E731
                print(f"{f'baseline, {real(c) - 1} slots':42s} {time_ms(graphed(fn)):8.4f} ms", flush=True)
            finally:
                head_cuda._slots = real
    finally:
        for file in files:
            (_backend._CSRC / file).unlink()


if __name__ == "__main__":
    main()
