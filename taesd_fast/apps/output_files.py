"""Writing output files safely: never over an input, never over an existing file unasked, never half-written.

Every command that writes files (the CLI's encode, decode, roundtrip, lipsync, and any later one) first calls
`check_outputs` with all its inputs (the model's weights files among them) and all its outputs, so a bad path fails
before anything is written, and then
writes each output through `atomic_write`, so a failure leaves the previous file (or none) in place, never a
truncated one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

OVERWRITE_FLAG = "--overwrite"


def check_outputs(inputs: Iterable[str | os.PathLike | None], outputs: Iterable[str | os.PathLike], *,
                  overwrite: bool, weights: Iterable[str | os.PathLike] = ()) -> None:
    """Raise before any work when an output would replace an input, another output, a folder, or (without
    `overwrite`) an existing file, or when its folder cannot be written.

    `weights`: the weights files the command loads its model from. They are inputs too, named as such in the
    message: `--overwrite` never replaces them either.
    Paths are compared as files, not as text: symlinks, hard links, `./x` against `x` and `d/` against `d` all
    resolve to the same file (os.path.samefile), and two outputs collide when their resolved paths are equal.
    """
    existing_inputs = [(Path(p), "input") for p in inputs if p is not None and Path(p).exists()]
    existing_inputs += [(Path(p), "weights file") for p in weights if Path(p).exists()]
    seen: dict[str, Path] = {}
    probed: set[Path] = set()
    for out in map(Path, outputs):
        key = os.path.normcase(os.path.realpath(out))
        if key in seen:
            raise ValueError(f"two outputs would both be written to {out} (also {seen[key]}); give the inputs "
                             "different names or write them to separate folders")
        seen[key] = out
        if out.is_dir():
            raise IsADirectoryError(f"output {out} is an existing folder; name a file")
        if out.exists():
            same = next(((p, what) for p, what in existing_inputs if os.path.samefile(out, p)), None)
            if same is not None:
                raise ValueError(f"output {out} is the {same[1]} {same[0]}; refusing to overwrite an input (even "
                                 f"with {OVERWRITE_FLAG}), choose another output path")
        if (out.exists() or out.is_symlink()) and not overwrite:
            raise FileExistsError(f"output {out} already exists; pass {OVERWRITE_FLAG} to replace it")
        check_writable_folder(out, probed)


def check_writable_folder(out: Path, probed: set[Path] | None = None) -> None:
    """The folder `out` goes into can take a new file: tried for real (a temporary file made and removed at once)
    in its nearest existing folder, so that nothing is created before every check has passed. A real try, not
    os.access, because permission bits do not tell about root, read-only mounts or /sys."""
    folder = Path(os.path.abspath(out)).parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write {out}: {folder} is a file, not a folder")
    if probed is not None and folder in probed:
        return
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write {out}: {err.strerror or err} (in {folder})") from err
    if probed is not None:
        probed.add(folder)


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `path`'s folder (same suffix, so writers that go by it pick the right format);
    when the block succeeds it replaces `path` in one step (os.replace), else it is deleted.

    The folder is created if needed. OS errors on the way (no permission, read-only file system) become one
    OSError that names `path`, not the temporary file.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".part{path.suffix}")
        os.close(fd)
    except OSError as err:
        raise OSError(f"cannot write {path}: {err.strerror or err}") from err
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, _default_mode())  # mkstemp makes it private; give it the mode a plain open() would
        os.replace(temporary, path)
    except BaseException as err:
        temporary.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename == str(temporary):
            raise OSError(f"cannot write {path}: {err.strerror or err}") from err
        raise


def _default_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
