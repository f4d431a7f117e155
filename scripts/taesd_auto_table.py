"""What dispatch picked per layer for TAEF2 (bundled weights, f16) on this GPU, in auto mode.

    python3 scripts/taesd_auto_table.py [--size 512] [--batch 1] [--graph]

--graph: decide as CUDAGraphed does (candidates timed as graph replays) and also time the replay.
"""
import argparse

import torch

from taesd_fast import TAESD, CUDAGraphed, dispatch
from taesd_fast.timing import time_ms

ap = argparse.ArgumentParser()
ap.add_argument("--size", type=int, default=512)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--graph", action="store_true")
args = ap.parse_args()
m = TAESD.from_pretrained(encoder_path="weights/taef2_encoder.safetensors",
                          decoder_path="weights/taef2_decoder.safetensors", dtype=torch.float16, device="cuda")
image = torch.rand(args.batch, 3, args.size, args.size, device="cuda", dtype=torch.float16)
with torch.no_grad():
    if args.graph:
        encode = CUDAGraphed(m.encode, image)
        latents = encode(image)
        decode = CUDAGraphed(m.decode, latents)
        print(f"graph replay ms: encode {time_ms(lambda: encode(image)):.4f}, decode {time_ms(lambda: decode(latents)):.4f}")
    else:
        dispatch.tune(m.decode, dispatch.tune(m.encode, image))
print(dispatch.dispatch_table(m))
