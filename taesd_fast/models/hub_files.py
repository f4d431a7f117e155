"""Files of a Hugging Face Hub repo through huggingface_hub's download and cache, for every model's loader (TAESD,
TAEHV, the Wan head): one short probe of the Hub per process instead of huggingface_hub's 25 s of retries without a
network, the cache alone when offline or unreachable, and the messages that say how to work offline."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..validation import user_stacklevel
from .weights_io import reader_reason

# How long to wait for the Hub's first answer. Without a network, huggingface_hub retries a file it has not cached
# with back-off (1 + 2 + 4 + 8 + 8 s: 25 s per load, eleven log lines); one short probe first avoids that.
HUB_PROBE_SECONDS = 2.0
OFFLINE_HINT = ("to work offline, download the weights once while online (huggingface_hub caches them) and set "
                "HF_HUB_OFFLINE=1, or pass a local path")
_hub_answers: dict[str, BaseException | None] = {}  # endpoint -> None when it answered, else why not; per process


def hub_unreachable_reason() -> BaseException | None:
    """Why the Hugging Face Hub cannot be reached now, or None when it answers.

    One HEAD request to huggingface_hub's endpoint (HF_ENDPOINT honoured) through its own HTTP session, waited
    for at most HUB_PROBE_SECONDS in a helper thread (so that a slow DNS lookup cannot hold the caller either).
    Any HTTP answer counts as reachable. The result is kept for the rest of the process: later loads decide at once.
    """
    import threading

    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    if endpoint in _hub_answers:
        return _hub_answers[endpoint]
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_SECONDS)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - whatever stops the request is the reason to report
            outcome.append(err)

    thread = threading.Thread(target=probe, name="taesd_fast-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS)
    reason = outcome[0] if outcome else TimeoutError(f"no answer from {endpoint} within {HUB_PROBE_SECONDS:g} s")
    _hub_answers[endpoint] = reason
    return reason


def hub_offline_env() -> bool:
    """HF_HUB_OFFLINE, read at call time (huggingface_hub reads it once, at import), so setting it later works."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


class HubFiles:
    """Files of one Hub repo through huggingface_hub's download and cache, for loaders that try several names.

    `offline` (local_files_only, or HF_HUB_OFFLINE) asks the cache only. Otherwise the Hub is probed once per
    process (hub_unreachable_reason); when it does not answer, or once a download fails to reach it, files come from
    the cache only (no waiting on the network), `unreachable` keeps why for the caller's error message, and a file
    found in the cache all the same comes with one warning that says how to work offline. `tried` lists the names
    asked for."""

    def __init__(self, repo_id: str, *, revision=None, cache_dir=None, local_files_only: bool = False,
                 subfolder: str | None = None):
        self.repo_id, self.revision, self.cache_dir, self.subfolder = repo_id, revision, cache_dir, subfolder
        self.offline = local_files_only or hub_offline_env()
        self.unreachable: BaseException | None = None if self.offline else hub_unreachable_reason()
        self.tried: list[str] = []
        self._warned = False

    def get(self, filename: str, record: bool = True) -> Path | None:
        """The file's local path, or None when the repo (or, offline, the cache) has no such file."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        if record:
            self.tried.append(filename)
        try:
            path = Path(hf_hub_download(self.repo_id, filename, subfolder=self.subfolder, revision=self.revision,
                                        cache_dir=self.cache_dir,
                                        local_files_only=self.offline or self.unreachable is not None))
        except LocalEntryNotFoundError as err:  # not cached, and the Hub was not asked or did not answer
            if not self.offline and self.unreachable is None:
                self.unreachable = err.__cause__ or err
            return None
        except EntryNotFoundError:  # the Hub answered: no such file in the repo
            return None
        if self.unreachable is not None and not self._warned:
            self._warned = True
            warnings.warn(f"the Hugging Face Hub cannot be reached ({self.unreachable_reason()}); using the cached "
                          f"copy of {self.repo_id} ({filename}), which may be out of date; {OFFLINE_HINT}",
                          stacklevel=user_stacklevel())
        return path

    def unreachable_reason(self) -> str:
        """`unreachable` as 'ExceptionType: reason' for messages."""
        return f"{type(self.unreachable).__name__}: {reader_reason(self.unreachable)}"


def require_repo_id(name: str | os.PathLike, example: str = "madebyollin/taesd") -> str:
    """`name` when it can be a Hub repo id ('owner/name'); a missing local path raises FileNotFoundError."""
    name = str(name)
    owner, _, repo = name.partition("/")
    looks_like_path = (not owner or not repo or "/" in repo or name.startswith(".") or ".." in name
                       or Path(name).suffix in (".pth", ".pt", ".safetensors", ".bin"))
    if looks_like_path:
        raise FileNotFoundError(
            f"{name!r} is neither an existing local folder nor a Hub repo id like '{example}' "
            "(no file or folder exists at that path)"
        )
    return name
