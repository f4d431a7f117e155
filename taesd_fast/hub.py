"""Locating TAESD weights: Hub repo ids (through huggingface_hub and its cache), local folders, explicit files.

Formats: upstream `<variant>_encoder/_decoder.{safetensors,pth}` (bare nn.Sequential keys), and the diffusers
AutoencoderTiny layout (`config.json` + `diffusion_pytorch_model.safetensors`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .architecture import VARIANTS, Architecture, build_decoder, build_encoder
from .weights_io import StateDict, WeightsError, from_diffusers, read_state_dict

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_CONFIG = "config.json"
BUNDLED_DIR = Path(__file__).resolve().parent / "weights"
BUNDLED_DEFAULT = "taef2"  # the real TAEF2 weights shipped with the package (MIT, madebyollin/taesd)


@dataclass
class LoadedWeights:
    encoder: StateDict | None
    decoder: StateDict | None
    name_hint: str | None  # a variant name found in the repo id, folder or file names
    sources: list[str] = field(default_factory=list)  # for error messages
    config: dict = field(default_factory=dict)  # the diffusers config.json, when the source has one


def variant_hint(*names: str | os.PathLike | None) -> str | None:
    """The longest known variant name contained in any of the given names ('taesdxl' beats 'taesd')."""
    found = [v for n in names if n for v in VARIANTS if v in Path(str(n)).name.lower()]
    return max(found, key=len) if found else None


def _upstream_file_candidates(stem: str) -> list[tuple[str, str]]:
    return [(f"{stem}_encoder{ext}", f"{stem}_decoder{ext}") for ext in (".safetensors", ".pth")]


def load_from_files(encoder_path=None, decoder_path=None) -> LoadedWeights:
    enc = read_state_dict(encoder_path) if encoder_path else None
    dec = read_state_dict(decoder_path) if decoder_path else None
    return LoadedWeights(enc, dec, variant_hint(encoder_path, decoder_path), [str(p) for p in (encoder_path, decoder_path) if p])


def load_from_folder(folder: Path, load_encoder: bool, load_decoder: bool) -> LoadedWeights:
    folder = Path(folder)
    if (folder / DIFFUSERS_WEIGHTS).is_file():
        return _load_diffusers(folder, load_encoder, load_decoder)
    for stem in [variant_hint(folder)] + [v for v in sorted(VARIANTS, key=len, reverse=True)]:
        if stem is None:
            continue
        for enc_name, dec_name in _upstream_file_candidates(stem):
            enc, dec = folder / enc_name, folder / dec_name
            if (load_encoder and enc.is_file()) or (load_decoder and dec.is_file()):
                return load_from_files(enc if load_encoder and enc.is_file() else None, dec if load_decoder and dec.is_file() else None)
    raise FileNotFoundError(
        f"no TAESD weights in {folder}: expected {DIFFUSERS_WEIGHTS} (+ {DIFFUSERS_CONFIG}) "
        "or <variant>_encoder/_decoder .safetensors/.pth files (variant one of " + ", ".join(VARIANTS) + ")"
    )


def _load_diffusers(folder: Path, load_encoder: bool, load_decoder: bool) -> LoadedWeights:
    encoder, decoder = from_diffusers(read_state_dict(folder / DIFFUSERS_WEIGHTS))
    hint = variant_hint(folder)
    config_path = folder / DIFFUSERS_CONFIG
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") not in (None, "AutoencoderTiny"):
        raise WeightsError(f"{config_path} describes a {config['_class_name']}, not an AutoencoderTiny")
    return LoadedWeights(encoder if load_encoder else None, decoder if load_decoder else None, hint, [str(folder)],
                         config)


def load_from_hub(repo_id: str, *, load_encoder: bool, load_decoder: bool, revision=None, cache_dir=None,
                  local_files_only: bool = False, subfolder: str | None = None) -> LoadedWeights:
    """Download (or find in the huggingface_hub cache) the files of a repo and load them.

    Tries the diffusers layout first, then upstream files named after the repo. `HF_HUB_OFFLINE=1` is honoured by
    huggingface_hub itself.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo_id, filename, subfolder=subfolder, revision=revision,
                                        cache_dir=cache_dir, local_files_only=local_files_only))
        except (EntryNotFoundError, LocalEntryNotFoundError):
            return None

    tried: list[str] = []
    weights = fetch(DIFFUSERS_WEIGHTS)
    tried.append(DIFFUSERS_WEIGHTS)
    if weights is not None:
        fetch(DIFFUSERS_CONFIG)  # optional, validated when present
        loaded = _load_diffusers(weights.parent, load_encoder, load_decoder)
        loaded.name_hint = variant_hint(repo_id)
        return loaded
    stem = variant_hint(repo_id) or repo_id.split("/")[-1].lower()
    for enc_name, dec_name in _upstream_file_candidates(stem):
        enc = fetch(enc_name) if load_encoder else None
        dec = fetch(dec_name) if load_decoder else None
        tried += [n for n, want in ((enc_name, load_encoder), (dec_name, load_decoder)) if want]
        if (enc or not load_encoder) and (dec or not load_decoder):
            loaded = load_from_files(enc, dec)
            loaded.name_hint = variant_hint(repo_id)
            return loaded
    offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    where = "in the local huggingface_hub cache (offline mode)" if offline else "on the Hub or in the local cache"
    raise FileNotFoundError(
        f"could not find TAESD weights for repo '{repo_id}'"
        + (f" (subfolder '{subfolder}')" if subfolder else "")
        + (f" at revision '{revision}'" if revision else "")
        + f" {where}; tried: {', '.join(tried)}."
        + (" Download them once while online, or pass local paths." if offline else "")
    )


def resolve(name_or_path: str | os.PathLike | None, *, encoder_path=None, decoder_path=None, load_encoder=True,
            load_decoder=True, **hub_kwargs) -> LoadedWeights:
    """Find and read the state dicts for any accepted source."""
    if encoder_path is not None or decoder_path is not None:
        if name_or_path is not None:
            raise ValueError("pass either name_or_path or encoder_path/decoder_path, not both")
        return load_from_files(encoder_path, decoder_path)
    if name_or_path is None:
        return load_from_folder(BUNDLED_DIR, load_encoder, load_decoder)
    path = Path(name_or_path)
    if path.is_dir():  # a local copy of a repo: subfolder means the same as on the Hub
        return load_from_folder(path / (hub_kwargs.get("subfolder") or ""), load_encoder, load_decoder)
    if path.is_file():
        raise ValueError(f"{path} is a single file: pass encoder_path= and/or decoder_path= instead")
    return load_from_hub(require_repo_id(name_or_path), load_encoder=load_encoder, load_decoder=load_decoder, **hub_kwargs)


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


def _shapes(state: StateDict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _architecture_mismatch(arch: Architecture, part: str, state: StateDict) -> str | None:
    """None when `state` fits `arch`'s encoder/decoder exactly, else what differs."""
    import torch

    with torch.device("meta"):
        module = build_encoder(arch) if part == "encoder" else build_decoder(arch)
    expected = _shapes(module.state_dict())
    got = _shapes(state)
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [f"{k}: {got[k]} vs {expected[k]}" for k in sorted(set(got) & set(expected)) if got[k] != expected[k]]
    if not (missing or unexpected or wrong):
        return None
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong)):
        if items:
            parts.append(f"{len(items)} {label} (e.g. {', '.join(items[:3])})")
    return "; ".join(parts)


def detect_architecture(loaded: LoadedWeights) -> Architecture:
    """The architecture the tensors describe. Raises if they fit none of the published ones."""
    parts = [(p, s) for p, s in (("encoder", loaded.encoder), ("decoder", loaded.decoder)) if s is not None]
    if not parts:
        raise WeightsError("no encoder or decoder weights were loaded")
    candidates = list(dict.fromkeys(VARIANTS.values()))
    for arch in candidates:
        if all(_architecture_mismatch(arch, p, s) is None for p, s in parts):
            return arch
    part, state = parts[0]
    raise WeightsError(
        f"the {part} weights from {', '.join(loaded.sources) or 'the given source'} match no published TAESD "
        f"architecture (tried {', '.join(a.describe() for a in candidates)})"
    )


def check_variant(arch: Architecture, variant: str | None, loaded: LoadedWeights) -> str:
    """Pick the variant name: the requested one or the hint must agree with the tensors."""
    for name, origin in ((variant, "requested variant"), (loaded.name_hint, "name")):
        if name is None:
            continue
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
        if VARIANTS[name] != arch:
            raise WeightsError(
                f"{origin} '{name}' ({VARIANTS[name].describe()}) disagrees with the weights in "
                f"{', '.join(loaded.sources)}, which are {arch.describe()}"
            )
        return name
    return next(n for n, a in VARIANTS.items() if a == arch)


def check_fits(arch: Architecture, part: str, state: StateDict, source: str) -> None:
    problem = _architecture_mismatch(arch, part, state)
    if problem:
        raise WeightsError(f"{part} weights from {source} do not fit a TAESD {part} with {arch.describe()}: {problem}")
