"""The `taesd-fast` command: encode, decode, roundtrip, lipsync, bench, info.

Exit codes: 0 success; 1 a user-facing error (missing file, bad shape, unusable weights, an output that exists),
printed as `taesd-fast: error: <message>` on one line (--debug or TAESD_FAST_DEBUG=1 show the traceback); 2 a usage
error (argparse). No command writes over a file it reads, or over an existing file without --overwrite, and every
output is written whole or not at all (taesd_fast.apps.output_files). Pillow/PyAV are imported only by the commands that
need them (the `media` extra).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..models.taesd.architecture import VARIANTS
from ..models.taesd.progress import item_progress
from . import tune_cli, video_cli
from .cli_support import (
    DEBUG_ENV, DTYPES, PROG, debug_wanted, load_model, model_param, one_line, one_line_warnings, output_paths,
    parse_tile, positive_int, print_error, print_note, resolve_device, silence_stdout, user_errors, wrong_suffix,
)
from .output_files import OVERWRITE_FLAG, atomic_write, check_outputs

if TYPE_CHECKING:
    from .latents_io import LatentsRecord

BACKENDS = ("auto", "torch", "kernels")
DECODE_BATCH = 16
PAD_HELP = ("images whose sides are not a multiple of the model's downscale factor (8; 32 for taesana) are padded "
            "by repeating their edge pixels, with a note, and the decoded result is cropped back to the original "
            "size (the default); --no-pad makes such images an error instead")
TILE_HELP = ("work in tiles of SIZE image pixels (a multiple of 8; 32 for taesana) to bound memory on large images, "
             "or 'auto' (the default): untiled when the image fits the free memory, else the largest tile that "
             "fits; the result equals the untiled one")


# ------------------------------------------------------------------------------------------------ arguments


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--weights", metavar="ID_OR_DIR",
                       help="Hub repo id (e.g. madebyollin/taesdxl) or local folder of TAESD weights "
                            "(default: the bundled TAEF2 weights, offline)")
    group.add_argument("--variant", choices=list(VARIANTS),
                       help="which variant's files to load when --weights names a folder or repo holding several")
    group.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    group.add_argument("--dtype", choices=DTYPES, help="model precision (default: float16 on CUDA, float32 on CPU)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="conv implementation: auto = measured per shape, torch = PyTorch only, "
                            "kernels = custom kernels wherever they apply (default: auto)")


def add_output_arguments(parser: argparse.ArgumentParser, metavar: str, tile: bool = True) -> None:
    """-o, --overwrite and (for image commands) --tile."""
    parser.add_argument("-o", "--output", type=Path, required=True, metavar=metavar)
    parser.add_argument(OVERWRITE_FLAG, action="store_true",
                        help="replace output files that already exist (inputs are never replaced)")
    if tile:
        parser.add_argument("--tile", type=parse_tile, default="auto", metavar="SIZE|auto", help=TILE_HELP)


def add_lipsync_arguments(parser: argparse.ArgumentParser) -> None:
    """The lip-sync options, shared by `taesd-fast lipsync` and examples/lipsync.py."""
    from .facebox import DEMO_CLIP, SUN_FACE_BOX

    parser.add_argument("video", type=Path, nargs="?",
                        help="talking-head video (any format PyAV/FFmpeg reads); default: the repository's 3 s demo "
                             f"clip examples/assets/{DEMO_CLIP.name}")
    add_output_arguments(parser, "OUT.mp4", tile=False)
    parser.add_argument("--box", default=str(SUN_FACE_BOX), metavar="X0,Y0,X1,Y1",
                        help="face box in pixels, ideally square; its lower half is replaced "
                             f"(default: {SUN_FACE_BOX}, the face in the demo clip)")
    parser.add_argument("--latents", type=Path,
                        help="[N, C, 32, 32] latents of the 256² face crops, one per frame, as .safetensors (key "
                             "'latents') or .pt; without it the crops are encoded and decoded (round trip)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="frames per model call (default: 8)")
    parser.add_argument("--max-frames", type=positive_int, help="process only the first N frames")
    parser.add_argument("--crf", type=int, default=18, help="H.264 quality, 0 = lossless, 51 = worst (default: 18)")
    parser.add_argument("--preset", default="veryfast",
                        help="libx264 speed preset, ultrafast ... veryslow: slower gives smaller files (default: veryfast)")
    add_model_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog=PROG, description="Fast TAESD tiny autoencoder: encode, decode, lip-sync "
                                     "video decoding, benchmarks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or {DEBUG_ENV}=1)")
    # Also accepted after the subcommand; SUPPRESS keeps a subcommand's default from undoing a --debug given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("encode", parents=[debug], help="images -> latents (.safetensors, or 8-bit .png)",
                       description="Encode images (or every image in a folder, sorted) to latents. -o is a file "
                                   "for one image, else a directory (one <name>.safetensors or <name>.png per "
                                   "image). The file records the model and the image size, for decode.")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE_OR_DIR")
    add_output_arguments(p, "OUT")
    p.add_argument("--png", action="store_true",
                   help="write 8-bit latents PNGs (TAESD.scale_latents); only for models with at most 4 latent "
                        "channels (taesd, taesdxl), not the bundled 32-channel TAEF2")
    p.add_argument("--pad", action=argparse.BooleanOptionalAction, help=PAD_HELP + " (decode crops back to the "
                   "size recorded in the file)")
    add_model_arguments(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("decode", parents=[debug], help="latents (.safetensors, .pt, .png) -> images (.png)",
                       description="Decode latents files (or a folder of them) to PNG images. -o is a file for "
                                   "one latent, else a directory. Files with several latents [N, C, h, w] give "
                                   "<name>_0000.png, ... Latents made by another model than the loaded one are "
                                   "refused; padded images are cropped back to their recorded size.")
    p.add_argument("latents", nargs="+", type=Path, metavar="LATENTS_OR_DIR")
    add_output_arguments(p, "OUT")
    add_model_arguments(p)
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("roundtrip", parents=[debug], help="encode + decode images, print PSNR",
                       description="Encode and decode each image (or every image in a folder, sorted), write "
                                   "<OUTDIR>/<name>.png, print its PSNR.")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE_OR_DIR")
    add_output_arguments(p, "OUTDIR")
    p.add_argument("--pad", action=argparse.BooleanOptionalAction, help=PAD_HELP)
    add_model_arguments(p)
    p.set_defaults(func=cmd_roundtrip)

    p = sub.add_parser("lipsync", parents=[debug], help="decode lip-sync face latents into a talking-head video",
                       description="Crop the face box of every frame to 256², decode its latents (or round-trip the "
                                   "crop), paste the lower half of the face back with a feathered mask, and write an "
                                   "mp4 with the same fps, size and audio. Prints decode and end-to-end fps.")
    add_lipsync_arguments(p)
    p.set_defaults(func=cmd_lipsync)

    # Listed for --help only: main() forwards everything after `bench` to taesd_fast.apps.bench.cli.main untouched.
    sub.add_parser("bench", help="benchmarks, need a CUDA GPU (taesd-fast bench --help for its options)",
                   add_help=False)

    p = sub.add_parser("info", parents=[debug], help="versions, device, kernel availability",
                       description="Print versions, the default device and whether the custom kernels can run.")
    p.add_argument("--model", action="store_true",
                   help="also load the model, run one small decode and print the dispatch table")
    add_model_arguments(p)
    p.set_defaults(func=cmd_info)

    tune_cli.add_parser(sub, add_model_arguments, load_model)
    video_cli.add_parser(sub)
    return parser


# ------------------------------------------------------------------------------------------------ helpers


def _image_inputs(args: argparse.Namespace, model) -> tuple[list[Path], list[tuple[int, int]]]:
    """The image files (folders expanded), and their (H, W): every one exists, is an image and (with --no-pad)
    fits the model, before any output is written."""
    from .media import IMAGE_SUFFIXES, check_image_file_size, collect_files, image_size

    paths = collect_files(args.images, IMAGE_SUFFIXES, "images")
    sizes = [image_size(path) for path in paths]
    if args.pad is False:
        for path, size in zip(paths, sizes):
            check_image_file_size(size, model.downscale, str(path))
    return paths, sizes


def _note_padding(args: argparse.Namespace, model, paths: list[Path], sizes: list[tuple[int, int]]) -> None:
    """Without --pad/--no-pad, a one-line note for each image that gets padded: images of any size work (the first
    image a user tries should), and the user should know that its latents cover a padded image. Printed once every
    check has passed, so that an error stays the only line of a failed command."""
    f = model.downscale
    for path, (height, width) in zip(paths, sizes):
        if args.pad is None and (height % f or width % f):
            print_note(f"{path} is {width}x{height}, not a multiple of {f} on each side: padded to "
                       f"{width + -width % f}x{height + -height % f} by repeating its edge pixels, and cropped back "
                       "to its size after decoding (--no-pad makes this an error)")


def _tile(args: argparse.Namespace, model, parts: tuple[str, ...]) -> int | str:
    """--tile for this model: 'auto' as it is; a size the model refuses is a one-line error; a size below the
    smallest efficient tile is raised to it here, once for the whole command (the model would warn at every
    encode and decode call)."""
    from ..models.taesd import tiling

    if args.tile == "auto":
        return "auto"
    tiling.check_tile_arguments(model, args.tile, None)
    overlap = max(tiling.overlap_pixels(model, part) for part in parts)  # the larger overlap needs the larger tile
    return tiling.efficient_tile(model, args.tile, overlap, "--tile ")


def _check_outputs(args: argparse.Namespace, inputs: list, outputs: list[Path]) -> None:
    """output_files.check_outputs with the weights files that --weights (or the bundled default) reads counted as
    inputs: no output replaces them, with or without --overwrite."""
    from ..models.taesd.hub import local_weights_files

    check_outputs(inputs, outputs, overwrite=args.overwrite, weights=local_weights_files(args.weights))


def _prepare(path: Path, model, pad: bool | None) -> torch.Tensor:
    """Load an image for the model, padded unless --no-pad (an image that needs it was refused before)."""
    from .media import load_image, pad_to_multiple

    image = load_image(path)
    if pad is not False:
        image = pad_to_multiple(image, model.downscale)
    param = model_param(model)
    return image.to(device=param.device, dtype=param.dtype)


def _load_checked_latents(path: Path, model) -> tuple[torch.Tensor, LatentsRecord | None]:
    """A latents file that the model can decode: made by it (by the file's record), or without a record (a
    warning) and of the model's channel count."""
    from .latents_io import load_latents

    latents, record = load_latents(path)
    if record is not None:
        record.check_model(model, path, cli=True)
    if record is None or record.variant is None:
        warnings.warn(f"{path} does not record which model made it (not written by taesd-fast encode); "
                      f"decoding it as {model.variant} latents", stacklevel=2)
    if latents.shape[1] != model.latent_channels:
        raise ValueError(f"{path} holds {latents.shape[1]}-channel latents but the {model.variant} model "
                         f"expects {model.latent_channels}; pass --weights for the VAE that made them")
    return latents, record


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1]."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


# ------------------------------------------------------------------------------------------------ commands


def cmd_encode(args: argparse.Namespace) -> int:
    from .latents_io import LatentsRecord, save_latents, save_latents_png

    as_png = args.png or args.output.suffix.lower() == ".png"
    if args.png and args.output.suffix.lower() == ".safetensors":
        raise ValueError(f"--png conflicts with -o {args.output}; name the output .png or drop --png")
    model = load_model(args, decoder=False)
    if as_png and model.latent_channels > 4:
        raise ValueError(f"--png needs a model with at most 4 latent channels; {model.variant} has "
                         f"{model.latent_channels} (use .safetensors, or --weights with taesd/taesdxl weights)")
    paths, sizes = _image_inputs(args, model)
    outputs = output_paths(paths, args.output, ".png" if as_png else ".safetensors")
    _check_outputs(args, paths, outputs)
    tile = _tile(args, model, ("encoder",))
    _note_padding(args, model, paths, sizes)
    with item_progress(len(paths), "encode", "image") as bar:
        for path, out, size in zip(paths, outputs, sizes):
            image = _prepare(path, model, args.pad)
            with torch.inference_mode():
                latents = model.encode(image, tile_size=tile, progress=True).float()
            with atomic_write(out) as partial:
                (save_latents_png if as_png else save_latents)(latents, partial, LatentsRecord.for_model(model, size))
            bar.write(f"{path} -> {out}  latents {tuple(latents.shape)}")
            bar.update()
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from .latents_io import LATENT_SUFFIXES
    from .media import collect_files, save_image

    paths = collect_files(args.latents, LATENT_SUFFIXES, "latents files")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"latents file not found: {', '.join(missing)}")
    model = load_model(args, encoder=False)
    param = model_param(model)
    loaded = [_load_checked_latents(path, model) for path in paths]  # every file is checked before any output
    outputs = output_paths(paths, args.output, ".png")
    names = [[out] if len(latents) == 1 else [out.with_name(f"{out.stem}_{i:04d}.png") for i in range(len(latents))]
             for out, (latents, _) in zip(outputs, loaded)]
    every_name = [name for group in names for name in group]
    _check_outputs(args, paths, every_name)
    tile = _tile(args, model, ("decoder",))
    with item_progress(len(every_name), "decode", "image") as bar:
        for path, (latents, record), group in zip(paths, loaded, names):
            size = record.image_size if record is not None else None
            for first in range(0, len(latents), DECODE_BATCH):  # in batches: a file may hold a whole video's latents
                batch = latents[first:first + DECODE_BATCH].to(device=param.device, dtype=param.dtype)
                with torch.inference_mode():
                    images = model.decode(batch, tile_size=tile, progress=True)
                if size is not None:  # the image size before encode padded it: drop the padding
                    images = images[..., : size[0], : size[1]]
                for image, name in zip(images, group[first:]):
                    with atomic_write(name) as partial:
                        save_image(image, partial)
                    bar.write(f"{path} -> {name}  {image.shape[-1]}x{image.shape[-2]}")
                    bar.update()
    return 0


def cmd_roundtrip(args: argparse.Namespace) -> int:
    from .media import save_image

    model = load_model(args)
    paths, sizes = _image_inputs(args, model)
    outputs = output_paths(paths, args.output, ".png")  # a suffix-less OUTDIR is always a directory
    _check_outputs(args, paths, outputs)
    tile = _tile(args, model, ("encoder", "decoder"))
    _note_padding(args, model, paths, sizes)
    with item_progress(len(paths), "roundtrip", "image") as bar:
        for path, out, (height, width) in zip(paths, outputs, sizes):
            image = _prepare(path, model, args.pad)
            with torch.inference_mode():
                latents = model.encode(image, tile_size=tile, progress=True)
                decoded = model.decode(latents, tile_size=tile, progress=True)[..., :height, :width]
            with atomic_write(out) as partial:
                save_image(decoded, partial)
            bar.write(f"{path}: PSNR {psnr(decoded, image[..., :height, :width]):.2f} dB ({width}x{height}) -> {out}")
            bar.update()
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
    if not args.video.is_file():
        raise FileNotFoundError(f"video not found: {args.video}")
    _check_outputs(args, [args.video, args.latents], [args.output])
    box = Box.parse(args.box)
    model = load_model(args, encoder=args.latents is None)  # decoding given latents needs no encoder
    latents = _load_checked_latents(args.latents, model)[0] if args.latents is not None else None
    stats = lipsync_video(args.video, args.output, model, box=box, latents=latents, batch_size=args.batch_size,
                          max_frames=args.max_frames, crf=args.crf, preset=args.preset)
    print(f"wrote {args.output}")
    print(stats.summary())
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        from .bench.cli import main as bench_main
    except ModuleNotFoundError as err:
        if err.name not in (f"{__package__}.bench", f"{__package__}.bench.cli"):
            raise
        raise RuntimeError("the benchmark module taesd_fast.apps.bench is not part of this install") from None
    return bench_main(argv, prog="taesd-fast bench") or 0


def cmd_info(args: argparse.Namespace) -> int:
    from .. import __version__, kernels_unavailable_reason

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
    from ..kernels import triton_conv

    t_reason = triton_conv.triton_unavailable_reason(device)
    print(f"Triton kernels (tensor-core conv, head norm): {'available' if t_reason is None else 'unavailable (' + t_reason + ')'}")
    if args.model:
        model = load_model(args, encoder=False)
        param = model_param(model)
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


def run_command(func, args: argparse.Namespace) -> int:
    """Run func(args) under --backend: errors a user can fix print one line and exit 1 (--debug: the traceback),
    warnings print one line each, and a closed stdout (`| head`) ends the command quietly."""
    from .. import backend

    try:
        with one_line_warnings(), backend(args.backend):
            code = func(args)
        sys.stdout.flush()  # a broken pipe shows here, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except BrokenPipeError:
        silence_stdout()
        return 1
    except ModuleNotFoundError as err:
        if err.name not in ("av", "PIL", "numpy") or debug_wanted(args):
            raise
        return print_error(f"this command needs the {err.name} package: pip install 'taesd_fast[media]'")
    except user_errors() as err:
        if debug_wanted(args):
            raise
        return print_error(one_line(err))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # Its own parser handles its options and --help.
        return run_command(lambda _: cmd_bench(argv[1:]), argparse.Namespace(backend="auto"))
    args = build_parser().parse_args(argv)  # exits with 2 on usage errors
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
