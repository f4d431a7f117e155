"""The `taesd-fast` command: encode, decode, roundtrip, lipsync, bench, info.

Exit codes: 0 success; 1 a user-facing error (missing file, bad shape, unusable weights), printed as
`taesd-fast: error: <message>` with no traceback (set TAESD_FAST_DEBUG=1 to get one); 2 a usage error (argparse).
Pillow/PyAV are imported only by the commands that need them (the `media` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .architecture import VARIANTS

PROG = "taesd-fast"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKENDS = ("auto", "torch", "kernels")
DECODE_BATCH = 16
PAD_HELP = ("pad images whose sides are not a multiple of 8 by repeating their edge pixels, and crop the decoded "
            "result back to the original size (without it, such images are an error)")


# ------------------------------------------------------------------------------------------------ arguments


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--weights", metavar="ID_OR_DIR",
                       help="Hub repo id (e.g. madebyollin/taesd) or local folder of TAESD weights "
                            "(default: the bundled TAEF2 weights, offline)")
    group.add_argument("--variant", choices=list(VARIANTS),
                       help="which variant's files to load when --weights names a folder or repo holding several")
    group.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    group.add_argument("--dtype", choices=DTYPES, help="model precision (default: float16 on CUDA, float32 on CPU)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="conv implementation: auto = measured per shape, torch = PyTorch only, "
                            "kernels = custom kernels wherever they apply (default: auto)")


def add_lipsync_arguments(parser: argparse.ArgumentParser) -> None:
    """The lip-sync options, shared by `taesd-fast lipsync` and examples/lipsync.py."""
    from .facebox import DEMO_CLIP, SUN_FACE_BOX

    parser.add_argument("video", type=Path, nargs="?",
                        help="talking-head video (any format PyAV/FFmpeg reads); default: the repository's demo "
                             f"clip examples/assets/{DEMO_CLIP.name}, the first 3 s of shared/data/video/sun.mp4")
    parser.add_argument("-o", "--output", type=Path, required=True, help="output .mp4 (H.264, same fps and size)")
    parser.add_argument("--box", default=str(SUN_FACE_BOX), metavar="X0,Y0,X1,Y1",
                        help="face box in pixels, ideally square; its lower half is replaced "
                             f"(default: {SUN_FACE_BOX}, the face in shared/data/video/sun.mp4)")
    parser.add_argument("--latents", type=Path,
                        help="[N, C, 32, 32] latents of the 256² face crops, one per frame, as .safetensors (key "
                             "'latents') or .pt; without it the crops are encoded and decoded (round trip)")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="frames per model call (default: 8)")
    parser.add_argument("--max-frames", type=_positive_int, help="process only the first N frames")
    parser.add_argument("--crf", type=int, default=18, help="H.264 quality, 0 = lossless, 51 = worst (default: 18)")
    parser.add_argument("--preset", default="veryfast",
                        help="libx264 speed preset, ultrafast ... veryslow: slower gives smaller files (default: veryfast)")
    add_model_arguments(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog=PROG, description="Fast TAESD tiny autoencoder: encode, decode, lip-sync "
                                     "video decoding, benchmarks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("encode", help="images -> latents (.safetensors, or 8-bit .png)",
                       description="Encode images to latents. -o is a file for one image, else a directory "
                                   "(one <name>.safetensors or <name>.png per image).")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT")
    p.add_argument("--png", action="store_true",
                   help="write 8-bit latents PNGs (TAESD.scale_latents); only for models with at most 4 latent "
                        "channels (taesd, taesdxl), not the bundled 32-channel TAEF2")
    p.add_argument("--pad", action="store_true", help=PAD_HELP + "; the original size is stored in the file")
    add_model_arguments(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("decode", help="latents (.safetensors, .pt, .png) -> images (.png)",
                       description="Decode latents files to PNG images. -o is a file for one latent, else a "
                                   "directory. Files with several latents [N, C, h, w] give <name>_0000.png, ...")
    p.add_argument("latents", nargs="+", type=Path, metavar="LATENTS")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT")
    add_model_arguments(p)
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("roundtrip", help="encode + decode images, print PSNR",
                       description="Encode and decode each image, write <OUTDIR>/<name>.png, print its PSNR.")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUTDIR")
    p.add_argument("--pad", action="store_true", help=PAD_HELP)
    add_model_arguments(p)
    p.set_defaults(func=cmd_roundtrip)

    p = sub.add_parser("lipsync", help="decode lip-sync face latents into a talking-head video",
                       description="Crop the face box of every frame to 256², decode its latents (or round-trip the "
                                   "crop), paste the lower half of the face back with a feathered mask, and write an "
                                   "mp4 with the same fps, size and audio. Prints decode and end-to-end fps.")
    add_lipsync_arguments(p)
    p.set_defaults(func=cmd_lipsync)

    # Listed for --help only: main() forwards everything after `bench` to taesd_fast.bench.main untouched.
    sub.add_parser("bench", help="benchmarks, need a CUDA GPU (taesd-fast bench --help for its options)",
                   add_help=False)

    p = sub.add_parser("info", help="versions, device, kernel availability",
                       description="Print versions, the default device and whether the custom kernels can run.")
    p.add_argument("--model", action="store_true",
                   help="also load the model, run one small decode and print the dispatch table")
    add_model_arguments(p)
    p.set_defaults(func=cmd_info)
    return parser


# ------------------------------------------------------------------------------------------------ helpers


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (expected e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} asked for CUDA, but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(args: argparse.Namespace, *, encoder: bool = True, decoder: bool = True):
    from .taesd import TAESD

    device = resolve_device(args.device)
    return TAESD.from_pretrained(args.weights, variant=args.variant, encoder=encoder, decoder=decoder, device=device,
                                 dtype=resolve_dtype(args.dtype, device))


def _param(model) -> torch.Tensor:
    return next(model.parameters())


def output_paths(inputs: list[Path], out: Path, suffix: str) -> list[Path]:
    """One output per input: `out` itself when it is a file name ending in `suffix` (one input only),
    else `out/<input stem><suffix>` (the directory is created)."""
    if out.suffix.lower() == suffix:
        if len(inputs) != 1:
            raise ValueError(f"-o {out} is a single file but {len(inputs)} inputs were given; pass a directory")
        out.parent.mkdir(parents=True, exist_ok=True)
        return [out]
    if out.suffix and not out.is_dir():
        raise wrong_suffix(out, f"a {suffix} file or a directory")
    stems = [p.stem for p in inputs]
    duplicates = sorted({s for s in stems if stems.count(s) > 1})
    if duplicates:
        raise ValueError(f"several inputs are named {', '.join(duplicates)}: their outputs in {out} would collide")
    out.mkdir(parents=True, exist_ok=True)
    return [out / f"{stem}{suffix}" for stem in stems]


def wrong_suffix(out: Path, expected: str) -> ValueError:
    """The error for an -o path whose suffix names the wrong kind of file."""
    given = f"a {out.suffix} file" if out.suffix else "a name without a suffix"
    return ValueError(f"-o {out}: expected {expected}, not {given}")


def _check_images(paths: list[Path], model, pad: bool) -> None:
    """Every input exists, is an image and (without --pad) fits the model, before any output is written."""
    from .media import check_image_file_size, image_size

    for path in paths:
        size = image_size(path)
        if not pad:
            check_image_file_size(size, model.downscale, str(path))


def _prepare(path: Path, model, pad: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """Load an image for the model, padded when asked; returns it with its original (H, W)."""
    from .media import load_image, pad_to_multiple

    image = load_image(path)
    size = tuple(image.shape[-2:])
    if pad:
        image = pad_to_multiple(image, model.downscale)
    param = _param(model)
    return image.to(device=param.device, dtype=param.dtype), size


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1]."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


# ------------------------------------------------------------------------------------------------ commands


def cmd_encode(args: argparse.Namespace) -> int:
    from .media import save_latents, save_latents_png

    as_png = args.png or args.output.suffix.lower() == ".png"
    if args.png and args.output.suffix.lower() == ".safetensors":
        raise ValueError(f"--png conflicts with -o {args.output}; name the output .png or drop --png")
    model = load_model(args, decoder=False)
    if as_png and model.latent_channels > 4:
        raise ValueError(f"--png needs a model with at most 4 latent channels; {model.variant} has "
                         f"{model.latent_channels} (use .safetensors, or --weights with taesd/taesdxl weights)")
    _check_images(args.images, model, args.pad)
    outputs = output_paths(args.images, args.output, ".png" if as_png else ".safetensors")
    for path, out in zip(args.images, outputs):
        image, size = _prepare(path, model, args.pad)
        with torch.inference_mode():
            latents = model.encode(image).float()
        kept_size = size if tuple(image.shape[-2:]) != size else None  # only padded images need cropping back
        (save_latents_png if as_png else save_latents)(latents, out, kept_size)
        print(f"{path} -> {out}  latents {tuple(latents.shape)}")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from .media import load_latents, save_image

    missing = [str(p) for p in args.latents if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"latents file not found: {', '.join(missing)}")
    model = load_model(args, encoder=False)
    param = _param(model)
    outputs = output_paths(args.latents, args.output, ".png")
    for path, out in zip(args.latents, outputs):
        latents, size = load_latents(path)
        if latents.shape[1] != model.latent_channels:
            raise ValueError(f"{path} holds {latents.shape[1]}-channel latents but the {model.variant} model "
                             f"expects {model.latent_channels}; pass --weights for the VAE that made them")
        names = [out] if len(latents) == 1 else [out.with_name(f"{out.stem}_{i:04d}.png") for i in range(len(latents))]
        for first in range(0, len(latents), DECODE_BATCH):  # in batches: a file may hold a whole video's latents
            with torch.inference_mode():
                images = model.decode(latents[first:first + DECODE_BATCH].to(device=param.device, dtype=param.dtype))
            if size is not None:  # encoded with --pad: drop the padding
                images = images[..., : size[0], : size[1]]
            for image, name in zip(images, names[first:]):
                save_image(image, name)
                print(f"{path} -> {name}  {image.shape[-1]}x{image.shape[-2]}")
    return 0


def cmd_roundtrip(args: argparse.Namespace) -> int:
    from .media import save_image

    model = load_model(args)
    _check_images(args.images, model, args.pad)
    outputs = output_paths(args.images, args.output, ".png")  # a suffix-less OUTDIR is always a directory
    for path, out in zip(args.images, outputs):
        image, (height, width) = _prepare(path, model, args.pad)
        with torch.inference_mode():
            decoded = model.decode(model.encode(image))[..., :height, :width]
        save_image(decoded, out)
        print(f"{path}: PSNR {psnr(decoded, image[..., :height, :width]):.2f} dB ({width}x{height}) -> {out}")
    return 0


def cmd_lipsync(args: argparse.Namespace) -> int:
    from .facebox import DEMO_CLIP
    from .lipsync import Box, lipsync_video

    if args.output.suffix.lower() != ".mp4":  # the writer would put H.264 in whatever container the suffix names
        raise wrong_suffix(args.output, "an .mp4 file")
    if args.video is None:
        if not DEMO_CLIP.is_file():
            raise FileNotFoundError(f"no video given, and the demo clip {DEMO_CLIP} is missing (it ships with the "
                                    "repository, not the installed package); pass a video")
        args.video = DEMO_CLIP
    box = Box.parse(args.box)
    model = load_model(args, encoder=args.latents is None)  # decoding given latents needs no encoder
    stats = lipsync_video(args.video, args.output, model, box=box, latents=args.latents, batch_size=args.batch_size,
                          max_frames=args.max_frames, crf=args.crf, preset=args.preset)
    print(f"wrote {args.output}")
    print(stats.summary())
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        from .bench import main as bench_main
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.bench":
            raise
        raise RuntimeError("the benchmark module taesd_fast.bench is not part of this install") from None
    return bench_main(argv, prog="taesd-fast bench") or 0


def cmd_info(args: argparse.Namespace) -> int:
    from . import __version__, kernels_unavailable_reason

    device = resolve_device(args.device)
    print(f"taesd_fast {__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    print(f"device: {device}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    print(f"GPU: {gpu}")
    reason = kernels_unavailable_reason(device if device.type == "cuda" else None)
    if reason is None and device.type != "cuda":
        reason = f"they run on CUDA devices, and the device is {device}"
    print(f"kernels: {'available' if reason is None else 'unavailable (' + reason + ')'}")
    from .kernels import conv_tc

    t_reason = conv_tc.triton_unavailable_reason(device)
    print(f"Triton kernels (tensor-core conv, head norm): {'available' if t_reason is None else 'unavailable (' + t_reason + ')'}")
    if args.model:
        model = load_model(args, encoder=False)
        param = _param(model)
        latents = torch.randn(1, model.latent_channels, 8, 8, device=device, dtype=param.dtype)
        with torch.inference_mode():
            tick = time.perf_counter()
            image = model.decode(latents)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - tick
        print(f"model: {model.variant} ({model.arch.describe()}), {param.dtype}, "
              f"decoded {tuple(latents.shape)} -> {tuple(image.shape)} in {elapsed * 1000:.1f} ms (first call)")
        print(model.dispatch_table())
    return 0


# ------------------------------------------------------------------------------------------------ entry point


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, RuntimeError)
    av = sys.modules.get("av")  # only a command that imported PyAV can raise its errors
    return errors + ((av.error.FFmpegError,) if av is not None else ())


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def run_command(func, args: argparse.Namespace) -> int:
    """Run func(args) under --backend, turning user-facing errors into a message and exit code 1."""
    from . import backend

    try:
        with backend(args.backend):
            return func(args)
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except ModuleNotFoundError as err:
        if err.name not in ("av", "PIL", "numpy"):
            raise
        return _error(f"this command needs the {err.name} package: pip install 'taesd_fast[media]'")
    except _user_errors() as err:
        if os.environ.get("TAESD_FAST_DEBUG", "0") not in ("", "0"):
            raise
        return _error(str(err))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # Its own parser handles its options and --help.
        return run_command(lambda _: cmd_bench(argv[1:]), argparse.Namespace(backend="auto"))
    args = build_parser().parse_args(argv)  # exits with 2 on usage errors
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
