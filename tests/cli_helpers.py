"""Helpers of the taesd-fast command-line tests: small real images, running the CLI in-process, checking that an
error is one line."""

from __future__ import annotations

from pathlib import Path

import torch

from taesd_fast import TAESD
from taesd_fast.apps.cli import main
from taesd_fast.models.weights_io import save_safetensors

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSET = REPO_ROOT / "examples" / "assets" / "monalisa.jpg"


def small_image(path: Path, width: int = 64, height: int = 96) -> Path:
    """The bundled painting resized to width x height, saved at `path` (the format follows its suffix)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(ASSET) as im:
        im.convert("RGB").resize((width, height), Image.BICUBIC).save(path)
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    """Exit status 1 and one line `taesd-fast: error: ...` holding every fragment, no traceback."""
    assert code == 1, err
    assert err.startswith("taesd-fast: error: "), err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err  # one line
    for fragment in fragments:
        assert fragment in err, err


def random_weights_folder(folder: Path, variant: str, seed: int = 0) -> Path:
    """<variant>_encoder/_decoder.safetensors of a randomly initialised model of that architecture in `folder`."""
    torch.manual_seed(seed)
    model = TAESD(variant)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(model.encoder.state_dict(), folder / f"{variant}_encoder.safetensors")
    save_safetensors(model.decoder.state_dict(), folder / f"{variant}_decoder.safetensors")
    return folder
