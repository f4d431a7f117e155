"""TAEF2 (bundled weights, f16) in auto mode on this GPU: print what dispatch picked per layer."""
import torch

from taesd_fast import TAESD, dispatch

m = TAESD.from_pretrained(encoder_path="weights/taef2_encoder.safetensors",
                          decoder_path="weights/taef2_decoder.safetensors", dtype=torch.float16, device="cuda")
with torch.no_grad():
    lat = dispatch.tune(m.encode, torch.rand(1, 3, 512, 512, device="cuda", dtype=torch.float16))
    dispatch.tune(m.decode, lat)
print(dispatch.dispatch_table(m))
