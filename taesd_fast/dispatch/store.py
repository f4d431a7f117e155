"""Timings on disk: one JSON file per cache dir (`<cache dir>/dispatch/timings.json`), shared by every process on
the machine. Writers take a file lock, re-read the file, merge their entries and replace the file atomically, so
concurrent processes lose nothing and a reader never sees half a file. This process keeps a copy in memory."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from filelock import FileLock

from .. import kernel_env

_lock = threading.Lock()  # guards the in-memory copy; never held while measuring
_memory: dict[str, dict] = {}  # key -> {"ms": {row: ms}, "failed": {row: why}}
_loaded_from: Path | None = None


def timings_path() -> Path:
    return kernel_env.cache_dir() / "dispatch" / "timings.json"


def read_json(path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def store_timings(entries: dict, path=None) -> dict:
    """Merge `entries` into the JSON file under a lock (re-read, update, atomic replace); returns the merged
    content. Safe with several processes and threads writing at once."""
    path = Path(timings_path() if path is None else path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=60):
        data = read_json(path)
        data.update(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return data


def _current() -> dict:
    """The in-memory copy for the current cache dir (re-read when TAESD_FAST_CACHE_DIR points elsewhere)."""
    global _memory, _loaded_from
    path = timings_path()
    if _loaded_from != path:
        _memory, _loaded_from = read_json(path), path
    return _memory


def get(key: str) -> dict | None:
    with _lock:
        return _current().get(key)


def put(key: str, ms: dict, failed: dict, path: Path | None = None) -> None:
    """Keep {ms, failed} for this process and persist both: a row that failed here (it does not build, or it ran
    out of the tuning process's memory budget) is not tried again on this machine until the timings file goes
    (`dispatch.clear_cache(disk=True)`) or the kernels or torch change (the key). `path`: the file chosen when
    the work was queued."""
    path = timings_path() if path is None else path
    try:
        merged = store_timings({key: {"ms": ms, **({"failed": failed} if failed else {})}}, path)
    except OSError:  # a read-only cache dir: keep the result for this process only
        merged = None
    with _lock:
        memory = _current()
        if merged is not None and path == _loaded_from:
            for k, v in merged.items():  # and whatever other processes stored meanwhile
                memory.setdefault(k, v)
        if path == _loaded_from:
            memory[key] = {"ms": ms, "failed": failed}


def remember(key: str, ms: dict, failed: dict) -> None:
    """Keep {ms, failed} for this process without writing: what the tuning process measured and stored (it
    wrote the file) or could not run. Entries other processes stored meanwhile are read in too."""
    with _lock:
        memory = _current()
        for k, v in read_json(_loaded_from).items():
            memory.setdefault(k, v)
        if ms or failed:
            memory[key] = {"ms": dict(ms), "failed": dict(failed)}


def clear(disk: bool = False) -> None:
    global _memory, _loaded_from
    with _lock:
        _memory, _loaded_from = {}, None
        if disk:
            with contextlib.suppress(OSError):
                timings_path().unlink()
