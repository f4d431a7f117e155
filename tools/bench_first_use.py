"""What a first use costs: the wall time of each of a user's first calls (TAESD decode and encode with the bundled TAEF2
weights, the Wan output head), each followed by a synchronize. Run it once with empty caches and once more:

    TAESD_FAST_CACHE_DIR=/tmp/tf TRITON_CACHE_DIR=/tmp/tc python3 scripts/bench_first_use.py cold
    TAESD_FAST_CACHE_DIR=/tmp/tf TRITON_CACHE_DIR=/tmp/tc python3 scripts/bench_first_use.py warm
"""

import sys
import time

t_start = time.perf_counter()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from taesd_fast import OutputHead, TAESD  # noqa: E402

tag = sys.argv[1] if len(sys.argv) > 1 else "run"


def report(what: str, seconds: float) -> None:
    print(f"[{tag}] {what}: {seconds:.3f} s", flush=True)


def timed(label: str, fn, calls: int) -> None:
    for i in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        report(f"{label} call {i + 1}", time.perf_counter() - t)


report("import", time.perf_counter() - t_start)
t = time.perf_counter()
taesd = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
report("from_pretrained", time.perf_counter() - t)
with torch.no_grad():
    lat = torch.randn(1, 32, 32, 32, device="cuda", dtype=torch.float16)
    timed("decode 256² B=1", lambda: taesd.decode(lat), 4)
    lat16 = torch.randn(16, 32, 32, 32, device="cuda", dtype=torch.float16)
    timed("decode 256² B=16", lambda: taesd.decode(lat16), 3)
    img = torch.rand(16, 3, 256, 256, device="cuda", dtype=torch.float16)
    timed("encode 256² B=16", lambda: taesd.encode(img), 3)
    head = OutputHead().cuda().bfloat16()
    feat1 = torch.randn(1, 256, 1, 352, 640, device="cuda").bfloat16()
    feat4 = torch.randn(1, 256, 4, 352, 640, device="cuda").bfloat16()
    cache = F.silu(torch.randn(1, 256, 2, 352, 640, device="cuda")).bfloat16()
    timed("head T=1 no cache", lambda: head(feat1), 2)
    timed("head T=4 + cache", lambda: head(feat4, cache), 3)
report("total", time.perf_counter() - t_start)
