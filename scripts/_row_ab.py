"""Temporary probe: conv_halo's Gluon kernel vs the CUDA one-box kernel (conv_row)."""
import sys, pathlib
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from taesd_fast.kernels import conv_halo
from taesd_fast.kernels import conv_tc as tc
from taesd_fast.kernels import conv_row
import os
conv_row.A_LBO_IS_K = int(os.environ.get("LBO", "1"))
from taesd_fast.timing import chain_us, time_ms
from taesd_fast.graphs import capture
from taesd_fast.taesd import TAESD
cl = torch.channels_last
cfg = tc.TCConfig(128, 4, 3, tile_w=16, halo_w=128)
tc.POISON_OUTPUT = True
g = torch.Generator(device="cuda").manual_seed(0)
print("GPU", torch.cuda.get_device_name(), flush=True)
def make(B, H, W, res):
    x = torch.randn(B, 64, H, W, device="cuda", generator=g).half().contiguous(memory_format=cl)
    w = (torch.randn(64, 64, 3, 3, device="cuda", generator=g) / 24).half()
    b = torch.randn(64, device="cuda", generator=g).half()
    r = torch.randn(B, 64, H, W, device="cuda", generator=g).half().contiguous(memory_format=cl) if res else None
    return x, w, b, r
for B, H, W, res, relu, bias in [(1, 256, 256, True, True, True), (1, 9, 130, False, False, False), (2, 37, 77, True, True, True),
                                 (3, 5, 300, True, False, True), (1, 1, 64, False, True, True), (16, 64, 128, True, True, True), (1, 200, 255, False, True, False)]:
    x, w, b, r = make(B, H, W, res)
    b = b if bias else None
    outs = {}
    for k in ("gluon", "cuda"):
        conv_halo.ROW_KERNEL = k
        try:
            outs[k] = tc.conv3x3_tc_launch(x, w, b, r, 1, relu, config=cfg); torch.cuda.synchronize()
        except Exception as e:
            print(f"{k} failed: {type(e).__name__}: {str(e)[:800]}", flush=True); outs[k] = None
    ref = torch.nn.functional.conv2d(x.double(), w.double(), None if b is None else b.double(), padding=1)
    ref = ref + r.double() if r is not None else ref
    ref = ref.relu() if relu else ref
    def rel(y): return float("nan") if y is None else ((y.double() - ref).norm() / ref.norm()).item()
    c = outs["cuda"]
    extra = ""
    if c is not None and not torch.equal(c, outs["gluon"]):
        d = (c.float() - outs["gluon"].float()).abs()
        bad = (d > 1e-2 * (1 + outs["gluon"].float().abs())) | c.isnan()
        idx = bad.nonzero()[:6].tolist()
        extra = f" nan {int(c.isnan().sum())} bad {int(bad.sum())}/{c.numel()} first {idx}"
    print(f"{B}x{H}x{W} res={res} relu={relu} bias={bias}: gluon {rel(outs['gluon']):.3e} cuda {rel(c):.3e} same bits {c is not None and torch.equal(c, outs['gluon'])}{extra}", flush=True)
tc.POISON_OUTPUT = False
for label, B, H, res, relu in [("256 B=1 b+r+relu", 1, 256, True, True), ("256 B=1 b+relu", 1, 256, False, True), ("128 B=1 b+r+relu", 1, 128, True, True),
                               ("256 B=16 b+r+relu", 16, 256, True, True), ("256 B=64 b+relu", 64, 256, False, True), ("512 B=1 b+relu", 1, 512, False, True), ("1024 B=1 b+r+relu", 1, 1024, True, True)]:
    x, w, b, r = make(B, H, H, res)
    y = torch.empty_like(x)
    t = {"gluon": [], "cuda": []}
    n = 20 if B * H * H <= 65536 * 16 else 5
    for k in ("gluon", "cuda") * 2:
        conv_halo.ROW_KERNEL = k
        try:
            t[k].append(chain_us(lambda _: tc.conv3x3_tc_launch(x, w, b, r, 1, relu, config=cfg, out=y), n))
        except Exception as e:
            t[k].append(float("nan")); print(k, "failed", type(e).__name__, str(e)[:300])
    print(f"{label}: gluon {t['gluon'][0]:.2f} {t['gluon'][1]:.2f} us, cuda {t['cuda'][0]:.2f} {t['cuda'][1]:.2f} us", flush=True)
torch.backends.cudnn.benchmark = True
model = TAESD("taesd").cuda().half().eval(); model.cuda_graphs = False
for label, B, size in [("decode 256 B=1", 1, 256), ("decode 512 B=1", 1, 512), ("decode 256 B=64", 64, 256), ("decode 1024 B=1", 1, 1024)]:
    x = torch.randn(B, 4, size // 8, size // 8, device="cuda", dtype=torch.float16)
    t = {"gluon": [], "cuda": []}; outs = {}
    for k in ("gluon", "cuda") * 3:
        conv_halo.ROW_KERNEL = k
        with torch.no_grad():
            replay, out = capture(lambda: model.decode(x))
        t[k].append(time_ms(replay)); outs[k] = out.clone()
    print(f"{label}: " + ", ".join(f"{k} " + " ".join(f"{v:.4f}" for v in t[k]) for k in t) + f" ms, same {torch.equal(outs['gluon'], outs['cuda'])}", flush=True)
