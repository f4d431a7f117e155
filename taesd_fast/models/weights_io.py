"""Reading weight files safely, and converting between the upstream and diffusers key layouts."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Callable

import torch

StateDict = dict[str, torch.Tensor]


class WeightsError(ValueError):
    """A weights file is missing, unreadable, or does not fit the model it was meant for."""


def read_state_dict(path: str | os.PathLike, keys: list[str] | None = None) -> StateDict:
    """Read tensors from a .safetensors or .pth file without unpickling arbitrary objects.

    keys: read only these tensors (lazily for safetensors, memory-mapped for .pth), for large checkpoints.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                names = f.keys() if keys is None else [k for k in keys if k in f.keys()]
                return {k: f.get_tensor(k) for k in names}
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))  # legacy .pth: no mmap
    except pickle.UnpicklingError as err:
        if "GLOBAL" not in str(err):  # the unpickler refused no Python object: the bytes are just damaged
            raise _unreadable(path, err) from err
        # weights_only refused an object: not damage, a safety refusal
        raise WeightsError(
            f"{path} holds Python objects other than tensors; they were not unpickled, because that could run "
            "arbitrary code. Re-save the file as a plain state_dict of tensors (or as .safetensors)."
        ) from err
    except Exception as err:  # every other reader error means the same thing to the user
        raise _unreadable(path, err) from err
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path} does not hold a flat state_dict of tensors")
    if keys is not None:
        state = {k: state[k] for k in keys if k in state}
    return dict(state)


def state_differences(state: StateDict, build: Callable[..., torch.nn.Module], *args) -> dict[str, list[str]]:
    """What differs between `state` and the state_dict of `build(*args)` (built on the meta device: no memory, no
    init): {"missing keys" | "unexpected keys" | "shape mismatches": items}, only the kinds found, each sorted by
    key; empty when every key and shape fits. Shape mismatches read "key: (got) vs (expected)"."""
    with torch.device("meta"):
        module = build(*args)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    found = {
        "missing keys": sorted(set(expected) - set(got)),
        "unexpected keys": sorted(set(got) - set(expected)),
        "shape mismatches": [f"{k}: {got[k]} vs {expected[k]}" for k in sorted(set(got) & set(expected))
                             if got[k] != expected[k]],
    }
    return {label: items for label, items in found.items() if items}


def _unreadable(path: Path, err: Exception) -> WeightsError:
    return WeightsError(
        f"could not read weights file {path} ({type(err).__name__}: {reader_reason(err)}). "
        "The file is corrupt, truncated or not a weights file; delete it and download it again."
    )


def reader_reason(err: Exception) -> str:
    """The reader's own reason, without torch.load's advice to retry with weights_only=False: for a damaged file
    that advice is wrong, and for an untrusted one unsafe."""
    text = str(err)
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if unpickler:
        return unpickler.group(1).strip().splitlines()[0]
    first_line = text.strip().splitlines()[0] if text.strip() else "no details"
    return first_line.split(". ")[0][:200]  # readers append advice after the first sentence


def save_safetensors(state: StateDict, path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


# diffusers' AutoencoderTiny keeps the same Sequentials under `encoder.layers.` / `decoder.layers.`, but its
# decoder applies the tanh clamp in forward, so its Sequential lacks index 0 and every decoder index is one less.
_DIFFUSERS_KEY = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$")


def from_diffusers(state: StateDict) -> tuple[StateDict, StateDict]:
    """diffusers AutoencoderTiny keys -> (upstream encoder keys, upstream decoder keys)."""
    encoder: StateDict = {}
    decoder: StateDict = {}
    for key, value in state.items():
        match = _DIFFUSERS_KEY.match(key)
        if match is None:
            raise WeightsError(f"unexpected key {key!r} in a diffusers AutoencoderTiny checkpoint")
        part, index, rest = match.group(1), int(match.group(2)), match.group(3)
        if part == "encoder":
            encoder[f"{index}.{rest}"] = value
        else:
            decoder[f"{index + 1}.{rest}"] = value
    return encoder, decoder


def to_diffusers(encoder: StateDict | None, decoder: StateDict | None) -> StateDict:
    """Upstream keys -> diffusers AutoencoderTiny keys (the inverse of `from_diffusers`)."""
    state: StateDict = {}
    for key, value in (encoder or {}).items():
        state[f"encoder.layers.{key}"] = value
    for key, value in (decoder or {}).items():
        index, rest = key.split(".", 1)
        state[f"decoder.layers.{int(index) - 1}.{rest}"] = value
    return state
