"""Shared fixtures: the bundled test data (real weights, photos), image loading, a faked Hub cache.

Every test runs from the repository alone. The real data it needs is bundled: the TAEF2 weights in weights/, a photo
and a talking-head clip in examples/assets/, three more photos and the real TAESANA encoder in tests/data/ (sources,
licences and sha256 in tests/data/README.md). The read-only folder ../shared, when it sits beside the repo, only adds
cases: tests marked `shared_extra` (such as checking the bundled safetensors against the upstream .pth files) are
deselected, not skipped, when it is absent, so a skip always means a missing GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "tests" / "data"
ASSETS_DIR = REPO_ROOT / "examples" / "assets"
SHARED_DIR = REPO_ROOT.parent / "shared"

# Real photos (MuseTalk demo assets, MIT): three faces and a painting.
PHOTOS = {
    "monalisa": ASSETS_DIR / "monalisa.jpg",
    "musk": DATA_DIR / "musk.png",
    "sit": DATA_DIR / "sit.jpeg",
    "yongen": DATA_DIR / "yongen.jpeg",
}
IMAGE_NAMES = tuple(PHOTOS)
TALKING_HEAD_CLIP = ASSETS_DIR / "sun_3s.mp4"  # 75 frames, 576x768, 25 fps
TAESANA_ENCODER_PTH = DATA_DIR / "taesana_encoder.pth"  # the real upstream file (madebyollin/taesd, MIT)


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_extra: an extra case that needs ../shared (deselected without it)")


def pytest_collection_modifyitems(config, items):
    if SHARED_DIR.is_dir():
        return
    extra = [item for item in items if item.get_closest_marker("shared_extra")]
    if extra:
        config.hook.pytest_deselected(items=extra)
        items[:] = [item for item in items if not item.get_closest_marker("shared_extra")]


def pytest_report_header(config):
    found = "found" if SHARED_DIR.is_dir() else "not found: the tests marked shared_extra are deselected"
    return f"optional data folder {SHARED_DIR}: {found}"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared, for tests marked `shared_extra` only (they are deselected when it is absent)."""
    assert SHARED_DIR.is_dir(), "a test that uses shared_dir must be marked shared_extra"
    return SHARED_DIR


def _upstream_pth_from_bundled(folder: Path, part: str) -> Path:
    """The bundled TAEF2 safetensors written the way upstream wrote its .pth files: torch.save of an OrderedDict of
    fp16 tensors with bare nn.Sequential keys, in a zip archive named like upstream's (taef2_encoder/data.pkl, ...).
    tests/test_taesd_real.py checks the bundled tensors against the real upstream .pth when ../shared has it."""
    from collections import OrderedDict

    from safetensors.torch import load_file

    from taesd_fast.models.taesd import hub

    state = load_file(str(hub.BUNDLED_DIR / f"taef2_{part}.safetensors"))
    path = folder / f"taef2_{part}.pth"
    by_layer = sorted(state, key=lambda key: (int(key.split(".")[0]), key))
    torch.save(OrderedDict((key, state[key]) for key in by_layer), path)
    return path


@pytest.fixture(scope="session")
def taef2_pth_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("taef2_pth")
    for part in ("encoder", "decoder"):
        _upstream_pth_from_bundled(folder, part)
    return folder


@pytest.fixture(scope="session")
def taef2_encoder_pth(taef2_pth_dir) -> Path:
    return taef2_pth_dir / "taef2_encoder.pth"


@pytest.fixture(scope="session")
def taef2_decoder_pth(taef2_pth_dir) -> Path:
    return taef2_pth_dir / "taef2_decoder.pth"


@pytest.fixture(scope="session")
def taesana_encoder_pth() -> Path:
    return TAESANA_ENCODER_PTH


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """A photo as a [1, 3, height, width] float32 tensor in [0, 1] (PIL bicubic resize, no crop)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB").resize((width, height), Image.BICUBIC)
        array = np.asarray(im, dtype=np.float32) / 255.0
    return torch.from_numpy(array.copy()).permute(2, 0, 1).unsqueeze(0).contiguous()


@pytest.fixture(scope="session")
def load_photo():
    """load_photo(name, height, width) -> [1, 3, H, W] float32 in [0, 1]; name is a key of PHOTOS."""

    def load(name: str, height: int, width: int) -> torch.Tensor:
        return load_image(PHOTOS[name], height, width)

    return load


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB for images in [0, 1]."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| / max |reference|, computed in float64."""
    actual, reference = actual.double(), reference.double()
    return ((actual - reference).abs().max() / reference.abs().max()).item()


def random_output_head(c_in: int = 256, seed: int = 0, *, gamma_spread: float = 0.2, weight_gain: float = 1.0,
                       patch_size: int | None = None):
    """OutputHead with random gamma around 1, weights scaled by weight_gain / sqrt(fan-in) (so most outputs lie
    inside the clamp) and a random bias; fp32 on the CPU."""
    from taesd_fast import OutputHead

    gen = torch.Generator().manual_seed(seed)
    head = OutputHead(c_in, 12, patch_size=patch_size)
    with torch.no_grad():
        head.norm_out.gamma.copy_(1 + gamma_spread * torch.randn(c_in, 1, 1, 1, generator=gen))
        head.conv_out.weight.copy_(torch.randn(12, c_in, 3, 3, 3, generator=gen) * (weight_gain / (27 * c_in) ** 0.5))
        head.conv_out.bias.copy_(0.1 * torch.randn(12, generator=gen))
    return head.eval()


def video_from_channels(out: torch.Tensor, p: int) -> torch.Tensor:
    """The Wan unpatchify written out slice by slice (independent of the package's rearrange): channel (c*p + s)*p + q
    of [B, C*p*p, T, H, W] is row offset q and column offset s of video channel c."""
    b, n, t, h, w = out.shape
    video = out.new_full((b, n // (p * p), t, h * p, w * p), float("nan"))
    for c in range(n // (p * p)):
        for s in range(p):
            for q in range(p):
                video[:, c, :, q::p, s::p] = out[:, (c * p + s) * p + q]
    return video


@pytest.fixture
def no_tf32():
    """cuDNN runs fp32 convs in TF32 by default, which would make an fp32 reference a ~1e-3 reference."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """The conv kernels' fresh outputs NaN-filled (conv_contract.POISON_OUTPUT), so that an element a kernel never
    writes fails the test."""
    from taesd_fast.kernels import conv_contract

    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)


def record_launches(monkeypatch, module, pick) -> list:
    """module.launch wrapped for the test: each call appends pick(its positional arguments) to the returned list, so
    a test can show that the kernel under test really ran, and with what."""
    calls = []
    real = module.launch

    def recording(*args, **kwargs):
        calls.append(pick(args))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "launch", recording)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# A huggingface_hub cache laid out the way hf_hub_download leaves it:
#   <cache>/models--<org>--<name>/refs/<revision>            -> text file holding the commit hash
#   <cache>/models--<org>--<name>/blobs/<sha256 of content>   -> the file's bytes (LFS files are named by sha256)
#   <cache>/models--<org>--<name>/snapshots/<commit>/<path>   -> relative symlink to ../../blobs/<sha256>
# ----------------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def populate_hub_cache(cache_dir: Path, repo_id: str, files: dict[str, Path], revision: str = "main",
                       commit: str | None = None) -> Path:
    """Put `files` ({path in repo: local file}) into a huggingface_hub cache as one commit; returns the snapshot dir."""
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if commit is None:
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()  # any 40-hex commit id
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)  # huggingface_hub writes it without a newline
    for repo_path, source in files.items():
        blob = storage / "blobs" / _sha256(source)
        if not blob.exists():
            shutil.copyfile(source, blob)
        pointer = snapshot / repo_path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        try:
            pointer.symlink_to(os.path.relpath(blob, pointer.parent))
        except OSError:  # no symlinks (Windows without developer mode): huggingface_hub copies instead
            shutil.copyfile(blob, pointer)
    return snapshot


@pytest.fixture
def hub_offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for huggingface_hub, which reads the variable once at import into constants.HF_HUB_OFFLINE."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(autouse=True)
def fresh_hub_probe(monkeypatch):
    """Each test starts without the process's remembered answer of the Hub probe (taesd_fast.models.hub_files), so
    one test's network (or a test's fake) does not decide for the next."""
    from taesd_fast.models import hub_files

    monkeypatch.setattr(hub_files, "_hub_answers", {})


@pytest.fixture
def hub_reachable(monkeypatch):
    """The Hub probe answers 'reachable' without a request: for tests whose faked hf_hub_download plays an online
    Hub."""
    from huggingface_hub import constants

    from taesd_fast.models import hub_files

    monkeypatch.setattr(hub_files, "_hub_answers", {constants.ENDPOINT: None})


@pytest.fixture
def no_network(monkeypatch):
    """Fail loudly if a test tries to reach the Hub (the CI machine has no network; a hang would be worse)."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@contextlib.contextmanager
def private_dispatch(cache_dir: Path, patch: pytest.MonkeyPatch):
    """Dispatch state and its timings file (in cache_dir) private to the block, blocking tuning unless the code
    inside asks otherwise, and the backend and tuning modes restored after it. `patch` sets the environment (the
    caller undoes it)."""
    from taesd_fast import dispatch

    patch.setenv("TAESD_FAST_CACHE_DIR", str(cache_dir))
    patch.setenv("TAESD_FAST_TUNING", "blocking")  # deterministic: tests of subprocess tuning ask for it
    dispatch.clear_cache()
    try:
        yield
    finally:
        dispatch.wait_for_tuning(timeout=60)
        dispatch.clear_cache()
        dispatch.set_backend("auto")
        dispatch.set_tuning(None)


@pytest.fixture
def isolated_dispatch(tmp_path, monkeypatch):
    """`private_dispatch` for one test."""
    with private_dispatch(tmp_path, monkeypatch):
        yield


def report_cases(names, run_case) -> None:
    """The child side of `interpret_cases`: one JSON line per case, `run_case(name)`'s dict or the error it raised,
    so the parent names the failing case."""
    for name in names:
        try:
            print(json.dumps(run_case(name)), flush=True)
        except Exception as e:  # noqa: BLE001 - reported per case
            print(json.dumps({"name": name, "error": f"{type(e).__name__}: {e}"}), flush=True)


def interpret_cases(script: str, expected, timeout: float = 300) -> dict:
    """Run `script --interpret-cases` with TRITON_INTERPRET=1 (set before triton is imported; it turns every Triton
    kernel of a process into Python, hence a process of its own) and return its JSON lines by "name". Skips the
    test when triton is missing; fails it when the subprocess fails or its names are not exactly `expected` (a
    missing one: the subprocess stopped before it)."""
    try:
        import triton  # noqa: F401
    except Exception as e:
        pytest.skip(f"triton not installed ({type(e).__name__}: {e}): the interpreter checks need it")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script, "--interpret-cases"], check=False, env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    results = {d["name"]: d for d in map(json.loads, filter(lambda ln: ln.startswith("{"), proc.stdout.splitlines()))}
    if proc.returncode != 0 or not results:
        pytest.fail(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    missing = [name for name in expected if name not in results]
    assert not missing, f"the interpreter subprocess stopped before its last case (no line for {missing})"
    assert set(results) == set(expected), f"unexpected case lines: {sorted(set(results) - set(expected))}"
    return results


def process_gone(pid: int, timeout: float) -> bool:
    """Whether process pid has exited within `timeout` s (a zombie, exited but not yet reaped, counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_kernel(monkeypatch, tmp_path):
    """The conv2d table reduced to PyTorch plus the fake row, here and in the tuning process; subprocess tuning."""
    import tuning_fakes
    from taesd_fast import dispatch
    from taesd_fast.dispatch import table, tuner

    tuning_fakes.CALLS.clear()
    monkeypatch.setattr(table, "ROWS", tuning_fakes.rows() + [r for r in table.ROWS if r.kind != "conv2d"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TAESD_FAST_TUNER_SETUP", "tuning_fakes:install")
    monkeypatch.setenv("FAKE_TUNING_LOG", str(tmp_path / "timings.log"))
    monkeypatch.setattr(tuner, "_warned", False)
    dispatch.set_tuning("subprocess")
    yield tmp_path / "timings.log"
    dispatch.wait_for_tuning(timeout=30)
