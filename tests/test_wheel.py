"""The package as a wheel, not as this checkout: build it, install it into a fresh virtualenv, and check that the
bundled weights and the CUDA sources (which live outside taesd_fast/ in the repository) are inside it and are what
the installed package reads.

The fresh venv sees this environment's site-packages through a .pth file, for torch and the other dependencies
only: a .pth line adds a plain path, so an editable taesd_fast installed here (a finder hook run by its own .pth) is
not loaded, and the child runs from an empty working directory without PYTHONPATH. The child asserts that it
imported the installed copy before anything else. CPU only; about 10-20 s, most of it the child's `import torch`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from taesd_fast import TAESD, kernel_env, resources

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("pyproject.toml", "README.md", "taesd_fast", "csrc", "weights")

# Runs in the fresh venv. argv[1]: the venv's prefix; argv[2]: where to write the results (JSON + tensors).
CHILD = r'''
import hashlib, json, re, sys
from pathlib import Path

prefix, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
import taesd_fast
package = Path(taesd_fast.__file__).resolve().parent
assert prefix in package.parents, f"imported {package}, not the wheel installed in {prefix}"

import torch
from taesd_fast import TAESD, _backend, kernel_env, resources
from taesd_fast.models.taesd import hub

csrc = resources.csrc_dir()
names = [p.name for p in resources.csrc_sources()]
# Every source name the installed code passes to the loader (string literals such as "conv3x3_f16.cu").
code = "".join(p.read_text() for p in package.rglob("*.py"))
referenced = sorted(set(re.findall(r"[\"']([\w.-]+\.cuh?)[\"']", code)))
read = {n: len(_backend._read_source(n)) for n in names if n.endswith(".cu")}  # prelude + body, as NVRTC gets it
digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()
files = {n: digest(resources.csrc_path(n)) for n in names}
files.update({"weights/" + p.name: digest(p) for p in resources.weights_dir().iterdir() if p.is_file()})

model = TAESD.from_pretrained()  # bundled TAEF2, offline
gen = torch.Generator().manual_seed(0)
latents = torch.randn(1, 32, 8, 8, generator=gen)
images = torch.rand(1, 3, 64, 64, generator=gen)
with torch.no_grad():
    torch.save({"decoded": model.decode(latents), "encoded": model.encode(images)}, out.with_suffix(".pt"))
out.write_text(json.dumps({
    "package": str(package), "csrc": str(csrc), "weights": str(resources.weights_dir()),
    "bundled_dir": str(hub.BUNDLED_DIR), "names": names, "referenced": referenced, "read": read,
    "sources_hash": kernel_env.sources_hash(), "files": files,
}))
'''


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, results of the child run in a fresh venv with that wheel installed)."""
    if importlib.util.find_spec("setuptools") is None:  # a failure, not a skip: CI must run this test
        pytest.fail("building the wheel needs setuptools>=77 in this environment (the `test` extra installs it)")
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy: setuptools leaves build/ and *.egg-info beside the sources, and a build/ left over from an
    # older tree could carry deleted files into the wheel.
    source = tmp / "source"
    source.mkdir()
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", tmp / "dist", source])
    (wheel,) = (tmp / "dist").glob("taesd_fast-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (purelib / "_outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))

    script, out, cwd = tmp / "child.py", tmp / "child.json", tmp / "cwd"
    script.write_text(CHILD)
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(TAESD_FAST_CACHE_DIR=str(tmp / "cache"), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    _run([python, script, venv, out], cwd=cwd, env=env)
    return wheel, json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


def test_wheel_holds_every_module_source_and_weight(installed):
    wheel, _, _ = installed
    inside = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for pattern in ("*.py", "*.json")
               for p in (ROOT / "taesd_fast").rglob(pattern)}
    missing = sorted(modules - inside)
    assert not missing, f"not in the wheel (add the subpackage to [tool.setuptools] packages): {missing}"
    sources = {f"taesd_fast/_csrc/{p.name}" for p in resources.csrc_sources(ROOT / "csrc")}
    weights = {f"taesd_fast/_weights/{p.name}" for p in (ROOT / "weights").iterdir() if p.is_file()}
    assert sources and weights
    assert sorted((sources | weights) - inside) == []


def test_installed_package_reads_its_own_sources(installed):
    _, child, _ = installed
    package = Path(child["package"])
    for key in ("csrc", "weights", "bundled_dir"):
        assert package in Path(child[key]).parents, (key, child[key])
    checkout = [p.name for p in resources.csrc_sources(ROOT / "csrc")]
    assert child["names"] == checkout
    unresolved = sorted(set(child["referenced"]) - set(child["names"]))
    assert child["referenced"] and not unresolved, f"sources named in the code but not shipped: {unresolved}"
    assert sorted(child["read"]) == [n for n in checkout if n.endswith(".cu")]
    assert all(size > 0 for size in child["read"].values())
    # The same names and bytes give the same hash, so installed and checkout kernels share dispatch timings.
    assert child["sources_hash"] == kernel_env.sources_hash()
    expected = {p.name: p for p in resources.csrc_sources(ROOT / "csrc")}
    expected.update({"weights/" + p.name: p for p in (ROOT / "weights").iterdir() if p.is_file()})
    assert child["files"] == {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in expected.items()}


def test_installed_from_pretrained_matches_the_checkout(installed):
    _, _, outputs = installed
    model = TAESD.from_pretrained()
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 32, 8, 8, generator=gen)
    images = torch.rand(1, 3, 64, 64, generator=gen)
    with torch.no_grad():
        decoded, encoded = model.decode(latents), model.encode(images)
    assert outputs["decoded"].shape == (1, 3, 64, 64) and outputs["encoded"].shape == (1, 32, 8, 8)
    torch.testing.assert_close(outputs["decoded"], decoded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs["encoded"], encoded, rtol=1e-5, atol=1e-6)


def test_checkout_lookup_without_symlinks():
    """In this checkout the sources and weights come from the top-level folders, and a missing file names both
    places it was looked for."""
    assert resources.csrc_dir() == ROOT / "csrc" and resources.weights_dir() == ROOT / "weights"
    assert not (ROOT / "taesd_fast" / "weights").exists() and not (ROOT / "taesd_fast" / "csrc").exists()
    with pytest.raises(FileNotFoundError, match=r"kernel source 'nope\.cu' is missing .*taesd_fast/_csrc/.*csrc/"):
        resources.csrc_path("nope.cu")
    assert re.fullmatch(r"[0-9a-f]{10}", kernel_env.sources_hash())
