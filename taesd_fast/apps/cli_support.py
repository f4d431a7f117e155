"""What the `taesd-fast` commands share: loading the model from the common options, naming outputs, and turning
errors and warnings into the one-line messages the command prints."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from ..validation import check_device

PROG = "taesd-fast"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEBUG_ENV = "TAESD_FAST_DEBUG"


# ------------------------------------------------------------------------------------------------ the model


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name, "--device")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(args: argparse.Namespace, *, encoder: bool = True, decoder: bool = True):
    """The model named by --weights/--variant/--device/--dtype. The API's messages name its keyword arguments;
    where the command line spells a choice differently, the message says the flag."""
    from ..models.taesd.hub import BUNDLED_DEFAULT, weights_hint
    from ..models.taesd.model import TAESD

    if args.weights is None and args.variant not in (None, BUNDLED_DEFAULT):
        raise FileNotFoundError(f"only {BUNDLED_DEFAULT} weights are bundled; for {args.variant}, pass "
                                + weights_hint(args.variant, cli=True))
    if args.weights is not None and Path(args.weights).is_file():
        raise ValueError(f"--weights {args.weights} is a file; pass the folder that holds it (with files named "
                         "<variant>_encoder/_decoder .safetensors or .pth) or a Hub repo id")
    device = resolve_device(args.device)
    try:
        return TAESD.from_pretrained(args.weights, variant=args.variant, encoder=encoder, decoder=decoder,
                                     device=device, dtype=resolve_dtype(args.dtype, device))
    except ValueError as err:
        if "pass variant=" not in str(err):
            raise
        raise ValueError(str(err).replace("pass variant=", "pass --variant")) from err


def model_param(model) -> torch.Tensor:
    return next(model.parameters())


# ------------------------------------------------------------------------------------------------ file names


def output_paths(inputs: list[Path], out: Path, suffix: str) -> list[Path]:
    """One output per input: `out` itself when it is a file name ending in `suffix` (one input only),
    else `out/<input stem><suffix>`. Nothing is created here: check_outputs checks them all first."""
    if out.suffix.lower() == suffix and not out.is_dir():
        if len(inputs) != 1:
            raise ValueError(f"-o {out} is a single file but {len(inputs)} inputs were given; pass a directory")
        return [out]
    if out.suffix and not out.is_dir():
        raise wrong_suffix(out, f"a {suffix} file or a directory")
    stems = [p.stem for p in inputs]
    duplicates = sorted({s for s in stems if stems.count(s) > 1})
    if duplicates:
        raise ValueError(f"several inputs are named {', '.join(duplicates)}: their outputs in {out} would collide")
    return [out / f"{stem}{suffix}" for stem in stems]


def wrong_suffix(out: Path, expected: str) -> ValueError:
    """The error for an -o path whose suffix names the wrong kind of file."""
    given = f"a {out.suffix} file" if out.suffix else "a name without a suffix"
    return ValueError(f"-o {out}: expected {expected}, not {given}")


def parse_tile(text: str) -> int | str:
    """--tile: a tile size in image pixels, or "auto" (the largest tile that fits the free memory)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a tile size in pixels or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 pixel, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ------------------------------------------------------------------------------------------------ messages


def user_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, RuntimeError)
    av = sys.modules.get("av")  # only a command that imported PyAV can raise its errors
    return errors + ((av.error.FFmpegError,) if av is not None else ())


def debug_wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def one_line(err: BaseException) -> str:
    """An exception as one line: OSError's errno text as "<file>: <reason>", line breaks folded, and a hint to
    tile when memory ran out."""
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    else:
        text = str(err) or type(err).__name__
    text = "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text:
        text += " (out of memory: try --tile auto, or a smaller --tile)"
    return text


def print_error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def print_note(message: str) -> None:
    """A one-line note on stderr, `taesd-fast: note: <message>`: something the command did for the user that they
    should know of (not a problem, so not a warning)."""
    print(f"{PROG}: note: {message}", file=sys.stderr)


@contextmanager
def one_line_warnings():
    """Warnings during a command print as `taesd-fast: warning: <message>`, one line each, every time."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{PROG}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield


def silence_stdout() -> None:
    """After a broken pipe (`taesd-fast info | head -1`), point stdout at /dev/null so that the interpreter's
    final flush does not fail again with an 'Exception ignored' message."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (stdout replaced, as under pytest)
        pass
    finally:
        os.close(devnull)
