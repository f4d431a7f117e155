"""`taesd-fast video ...`: TAEHV video commands (encode, decode, roundtrip), streamed one step at a time so memory
does not grow with the video's length. PyAV reads and writes the video, tqdm shows progress.

Latents files (.safetensors): tensor "latents" [N, T, C, h, w] (NTCHW, as TAEHV and the diffusion model use them)
and metadata "variant" (the TAEHV variant that made them), "fps", "frames" (the video's frame count, to trim the
decode to) and "height"/"width" (its size before padding to the model's multiple). A [T, C, h, w] tensor is read as
N = 1. `.pt` / `.pth` files holding a tensor (or {"latents": tensor}) are read too; pass --ncthw for diffusers'
[N, C, T, h, w] layout (e.g. a Wan pipeline's output_type="latent").

Outputs follow the CLI's rules (taesd_fast.apps.output_files): never over an input, an existing output only with
--overwrite, and each file written whole or not at all.
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.taehv.hub import VARIANTS, local_weights_files
from .cli_support import model_param, positive_int, resolve_device, resolve_dtype
from .latents_io import LATENTS_KEY, read_tensor_file
from .output_files import OVERWRITE_FLAG, atomic_write, check_outputs

DEFAULT_FPS = Fraction(16)  # Wan 2.1's frame rate, when neither the latents file nor --fps gives one


# ------------------------------------------------------------------------------------------------ arguments


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `video` with its subcommands to the CLI's subparsers; returns the `video` parser."""
    video = subparsers.add_parser("video", help="TAEHV video autoencoders: encode, decode, roundtrip (mp4)",
                                  description="Tiny video autoencoders (TAEHV: taew2_2, taew2_1, taehv, ...), "
                                              "streamed one latent frame at a time.")
    sub = video.add_subparsers(dest="video_command", required=True, metavar="VIDEO_COMMAND")

    p = sub.add_parser("decode", help="latents (.safetensors, .pt) -> .mp4",
                       description="Decode a latents file to an H.264 mp4 (streamed; prints fps).")
    p.add_argument("latents", type=Path, metavar="LATENTS")
    p.add_argument("-o", "--output", type=Path, required=True, help="output .mp4")
    p.add_argument("--ncthw", action="store_true", help="the latents are [N, C, T, h, w] (diffusers' layout)")
    p.add_argument("--fps", type=Fraction, help=f"frame rate (default: the file's, else {DEFAULT_FPS})")
    _add_common(p)
    p.set_defaults(func=cmd_decode)

    for name, func, output, short, long in (
        ("encode", cmd_encode, ".safetensors", ".mp4 (any video PyAV reads) -> latents .safetensors",
         "Encode a video to a latents file (NTCHW, with the variant, fps and size as metadata). Frames are padded "
         "to the model's multiple by edge replication."),
        ("roundtrip", cmd_roundtrip, ".mp4", "encode + decode a video, print PSNR and fps",
         "Encode and decode a video through the latent space (streamed), write the result with the same fps and "
         "size, print its PSNR."),
    ):
        p = sub.add_parser(name, help=short, description=long)
        p.add_argument("video", type=Path, metavar="VIDEO")
        p.add_argument("-o", "--output", type=Path, required=True, help=f"output {output}")
        p.add_argument("--max-frames", type=positive_int, help="use only the first N frames")
        _add_common(p, encoder=True)
        p.set_defaults(func=func)
    return video


def _add_common(p: argparse.ArgumentParser, encoder: bool = False) -> None:
    if not encoder or p.prog.endswith("roundtrip"):
        p.add_argument("--crf", type=int, default=18, help="H.264 quality, 0 = lossless, 51 = worst (default: 18)")
        p.add_argument("--preset", default="veryfast", help="libx264 speed preset (default: veryfast)")
    p.add_argument(OVERWRITE_FLAG, action="store_true", help="replace the output if it exists")
    group = p.add_argument_group("model")
    group.add_argument("--weights", metavar="FILE_DIR_OR_ID",
                       help="TAEHV weights: a .safetensors/.pth file, a folder, or a Hub repo id (default: the Hub "
                            "repo madebyollin/taehv)")
    group.add_argument("--variant", choices=list(VARIANTS),
                       help="which TAEHV" + (" (required unless --weights is a file)" if encoder else
                                             " (default: the one named in the latents file)"))
    group.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    group.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                       help="model precision (default: float16 on CUDA, float32 on CPU)")
    group.add_argument("--backend", choices=("auto", "torch", "kernels"), default="auto",
                       help="conv implementation (default: auto, measured per shape)")


# ------------------------------------------------------------------------------------------------ helpers


def check_output(args: argparse.Namespace, inputs: list[Path], suffix: str) -> None:
    """-o's suffix, then the shared rules (output_files): never over an input (the --weights file or the folder's
    variant files included, even with --overwrite), an existing output only with --overwrite, a folder that can be
    written."""
    if args.output.suffix.lower() != suffix:
        raise ValueError(f"-o {args.output}: expected a {suffix} file")
    check_outputs(inputs, [args.output], overwrite=args.overwrite,
                  weights=local_weights_files(args.weights, args.variant))


def _video_job(args: argparse.Namespace, suffix: str, decoder: bool):
    """Checks and loads shared by encode and roundtrip: (video info, model, clock)."""
    from .lipsync import probe

    check_output(args, [args.video], suffix)
    info = probe(args.video)
    if args.variant is None and (args.weights is None or not Path(args.weights).is_file()):
        raise ValueError(f"which TAEHV for {args.video}? pass --variant ({', '.join(VARIANTS)}) or --weights FILE")
    model = load_model(args, args.variant, encoder=True, decoder=decoder)
    return info, model, _Clock(model_param(model).device)


def load_model(args: argparse.Namespace, variant: str | None, *, encoder: bool, decoder: bool):
    from ..models.taehv.model import TAEHV

    device = resolve_device(args.device)
    if args.weights is None and variant is None:
        raise ValueError(f"which TAEHV? pass --variant ({', '.join(VARIANTS)}) or --weights")
    return TAEHV.from_pretrained(args.weights, variant=variant, encoder=encoder, decoder=decoder, device=device,
                                 dtype=resolve_dtype(args.dtype, device))


def load_video_latents(path: Path, ncthw: bool = False) -> tuple[torch.Tensor, dict]:
    """A latents file -> ([N, T, C, h, w] float tensor, metadata dict)."""
    if not path.is_file():
        raise FileNotFoundError(f"latents file not found: {path}")
    if path.suffix.lower() not in (".safetensors", ".pt", ".pth"):
        raise ValueError(f"{path}: expected a .safetensors, .pt or .pth latents file")
    latents, metadata = read_tensor_file(path)
    if not latents.dtype.is_floating_point or latents.dim() not in (4, 5):
        raise ValueError(f"{path}: latents must be a floating point [N, T, C, h, w] or [T, C, h, w] tensor, "
                         f"got {latents.dtype} {tuple(latents.shape)}")
    if latents.dim() == 4:
        latents = latents.unsqueeze(0)
    if ncthw:
        latents = latents.transpose(1, 2)
    return latents, metadata


def _metadata_int(metadata: dict, key: str) -> int | None:
    try:
        return int(metadata[key])
    except (KeyError, ValueError):
        return None


def _frames_to_tensor(frames: list, multiple: int, model) -> torch.Tensor:
    """[H, W, 3] uint8 arrays -> [1, k, 3, H', W'] on the model's device and dtype, padded to `multiple` by edge
    replication."""
    param = model_param(model)
    x = torch.stack([torch.from_numpy(f) for f in frames]).to(param.device).permute(0, 3, 1, 2).to(param.dtype) / 255
    h, w = x.shape[-2:]
    pad_h, pad_w = -h % multiple, -w % multiple
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h), mode="replicate")
    return x.unsqueeze(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Model time (synchronised) apart from the whole command's time, for the fps report."""

    def __init__(self, device: torch.device):
        self.device, self.model_s, self.start = device, 0.0, time.perf_counter()

    def run(self, fn, *args, **kwargs):
        tick = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(self.device)
        self.model_s += time.perf_counter() - tick
        return out

    def report(self, frames: int, what: str, size: tuple[int, int]) -> str:
        total = time.perf_counter() - self.start
        return (f"{what} {frames} frames at {size[1]}x{size[0]}: model {self.model_s:.2f} s "
                f"({frames / max(self.model_s, 1e-9):.1f} fps), end to end {total:.2f} s ({frames / total:.1f} fps)")


def _to_hwc(frames: torch.Tensor, height: int, width: int):
    """[1, k, 3, H, W] uint8 -> list of [height, width, 3] numpy arrays (cropped)."""
    return list(frames[0, :, :, :height, :width].permute(0, 2, 3, 1).cpu().numpy())


# ------------------------------------------------------------------------------------------------ commands


def cmd_decode(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .lipsync import VideoWriter

    check_output(args, [args.latents], ".mp4")
    latents, metadata = load_video_latents(args.latents, args.ncthw)
    variant = args.variant or (metadata.get("variant") if metadata.get("variant") in VARIANTS else None)
    model = load_model(args, variant, encoder=False, decoder=True)
    if latents.shape[2] != model.latent_channels:
        hint = " (if it is [N, C, T, h, w], pass --ncthw)" if latents.shape[1] == model.latent_channels else ""
        raise ValueError(f"{args.latents} holds latents of shape {tuple(latents.shape)}; the {model.variant} model "
                         f"expects {model.latent_channels} channels at dim 2 (NTCHW){hint}")
    if latents.shape[0] != 1:
        raise ValueError(f"{args.latents} holds {latents.shape[0]} videos; decode writes one (batch 1)")
    param = model_param(model)
    fps = args.fps or (Fraction(metadata["fps"]) if "fps" in metadata else DEFAULT_FPS)
    scale = model.space_upscale
    height = _metadata_int(metadata, "height") or latents.shape[-2] * scale
    width = _metadata_int(metadata, "width") or latents.shape[-1] * scale
    total = latents.shape[1] * model.t_upscale - model.frames_to_trim
    keep = min(total, _metadata_int(metadata, "frames") or total)
    clock, state, count = _Clock(param.device), None, 0
    with atomic_write(args.output) as partial, torch.inference_mode(), \
            VideoWriter(partial, fps, width, height, crf=args.crf, preset=args.preset) as writer:
        for t in tqdm(range(latents.shape[1]), desc="decoding", unit="latent"):
            z = latents[:, t].to(param.device, param.dtype)
            frames, state = clock.run(model.decode_step, z, state, uint8=True)
            for frame in _to_hwc(frames, height, width)[: keep - count]:
                writer.write(frame)
                count += 1
    print(f"wrote {args.output} ({model.variant}, {fps} fps)")
    print(clock.report(count, "decoded", (height, width)))
    return 0


def _stream_encode(model, frames_iter, clock, multiple: int, on_latent) -> tuple[int, tuple[int, int]]:
    """Feed frames to encode_step t_downscale at a time; at the end pad with the last frame to 1 more than a
    multiple of t_downscale (so the decode, 4T - 3 frames, covers every frame) and to a whole step. Calls
    on_latent(latents [1, 1, C, h, w]) per latent; returns (frames read, (height, width))."""
    td = model.t_downscale
    pending, state, count, size, last = [], None, 0, None, None
    for frame in frames_iter:
        size = size or frame.shape[:2]
        if frame.shape[:2] != size:
            raise ValueError(f"frame {count} is {frame.shape[1]}x{frame.shape[0]}, the first was {size[1]}x{size[0]}")
        pending.append(frame)
        last, count = frame, count + 1
        if len(pending) == td:
            latents, state = clock.run(model.encode_step, _frames_to_tensor(pending, multiple, model), state)
            on_latent(latents)
            pending = []
    if count == 0:
        raise ValueError("the video has no frames")
    target = count + (-(count - 1)) % td  # the smallest count + pad that is 1 more than a multiple of td ...
    target += -target % td  # ... then encode_video's own padding to whole steps
    pending += [last] * (target - count)
    for first in range(0, len(pending), td):
        latents, state = clock.run(model.encode_step, _frames_to_tensor(pending[first:first + td], multiple, model),
                                   state)
        on_latent(latents)
    return count, size


def cmd_encode(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .lipsync import read_frames

    info, model, clock = _video_job(args, ".safetensors", decoder=False)
    out = []
    frames = tqdm(read_frames(args.video, args.max_frames), desc="encoding", unit="frame",
                  total=min(info.frames or 0, args.max_frames or info.frames or 0) or None)
    with torch.inference_mode():
        count, (height, width) = _stream_encode(model, frames, clock, model.arch.space_scale,
                                                lambda z: out.append(z.float().cpu()))
    latents = torch.cat(out, 1)
    metadata = {"variant": model.variant, "fps": str(info.fps), "frames": str(count), "height": str(height),
                "width": str(width)}
    with atomic_write(args.output) as partial:
        save_file({LATENTS_KEY: latents.contiguous()}, str(partial), metadata=metadata)
    print(f"wrote {args.output}: latents {tuple(latents.shape)} ({model.variant})")
    print(clock.report(count, "encoded", (height, width)))
    return 0


def cmd_roundtrip(args: argparse.Namespace) -> int:
    from collections import deque

    from tqdm import tqdm

    from .lipsync import VideoWriter, read_frames

    info, model, clock = _video_job(args, ".mp4", decoder=True)
    originals: deque = deque()  # input frames waiting for their decoded frame (a few steps' worth)
    squared_error, compared = 0.0, 0
    budget = args.max_frames or info.frames or None

    def source():
        for frame in read_frames(args.video, args.max_frames):
            originals.append(frame)
            yield frame

    with atomic_write(args.output) as partial, torch.inference_mode(), \
            VideoWriter(partial, info.fps, info.width, info.height, crf=args.crf, preset=args.preset) as writer:
        state = None

        def on_latent(latents):
            nonlocal state, squared_error, compared
            frames, state = clock.run(model.decode_step, latents, state, uint8=True)
            for frame in _to_hwc(frames, info.height, info.width):
                if not originals:  # decoded padding frames past the end of the input
                    return
                original = originals.popleft()
                diff = torch.from_numpy(frame).float() - torch.from_numpy(original).float()
                squared_error += diff.pow(2).mean().item()
                compared += 1
                writer.write(frame)

        frames_in = tqdm(source(), desc="round trip", unit="frame", total=budget)
        count, _ = _stream_encode(model, frames_in, clock, model.arch.space_scale, on_latent)
    mse = squared_error / max(compared, 1) / 255 ** 2
    psnr = float("inf") if mse == 0 else -10 * torch.log10(torch.tensor(mse)).item()
    print(f"wrote {args.output} ({model.variant}): PSNR {psnr:.2f} dB over {compared} frames")
    print(clock.report(count, "round trip of", (info.height, info.width)))
    return 0
