"""Where the package's data files are: the CUDA sources (csrc/) and the bundled weights (weights/).

In the repository both folders sit at the top level, beside taesd_fast/. A wheel carries them inside the package as
taesd_fast/_csrc and taesd_fast/_weights (pyproject.toml maps the two folders to those data packages). Neither place
needs a symlink, so a Windows clone works as a Linux one does.

The installed copy is looked for first, next to this file, then the checkout's folder next to the package: a source
checkout and an editable install have no taesd_fast/_csrc, so they read the top-level folders, and an installed
wheel never looks outside its own package. Paths are plain files on disk (pip installs wheels unpacked): NVRTC reads
the sources as text and safetensors memory-maps the weights.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["csrc_dir", "csrc_path", "csrc_sources", "weights_dir", "weights_path"]

_PACKAGE = Path(__file__).resolve().parent
_CSRC = ("_csrc", "csrc")  # (name inside an installed package, name at the top of a checkout)
_WEIGHTS = ("_weights", "weights")


def _folder(places: tuple[str, str]) -> Path:
    """The first of taesd_fast/<installed> and <checkout root>/<checkout> that exists; else the installed one, so
    that a later error names the place an install should have put the files."""
    installed, checkout = places
    candidates = (_PACKAGE / installed, _PACKAGE.parent / checkout)
    return next((folder for folder in candidates if folder.is_dir()), candidates[0])


def _file(places: tuple[str, str], name: str, what: str) -> Path:
    path = _folder(places) / name
    if not path.is_file():
        raise FileNotFoundError(f"taesd_fast: {what} {name!r} is missing (looked in {path.parent}; expected in "
                                f"taesd_fast/{places[0]}/ of an install or {places[1]}/ of a checkout)")
    return path


def csrc_dir() -> Path:
    """The folder holding the .cu/.cuh kernel sources."""
    return _folder(_CSRC)


def csrc_path(name: str) -> Path:
    """The kernel source file `name` (e.g. "conv3x3_f16.cu"); FileNotFoundError if it is missing."""
    return _file(_CSRC, name, "kernel source")


def csrc_sources(folder: Path | None = None) -> list[Path]:
    """Every .cu/.cuh file in `folder` (default: csrc_dir()), sorted by name."""
    folder = csrc_dir() if folder is None else folder
    return sorted(p for p in folder.iterdir() if p.suffix in (".cu", ".cuh")) if folder.is_dir() else []


def weights_dir() -> Path:
    """The folder holding the bundled TAEF2 weights, their licence and notes."""
    return _folder(_WEIGHTS)


def weights_path(name: str) -> Path:
    """The bundled file `name` (e.g. "taef2_decoder.safetensors"); FileNotFoundError if it is missing."""
    return _file(_WEIGHTS, name, "bundled file")
