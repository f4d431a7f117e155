"""Locating TAESD weights: Hub repo ids (through huggingface_hub and its cache), local folders, explicit files.

Formats: upstream `<variant>_encoder/_decoder.{safetensors,pth}` (bare nn.Sequential keys), and the diffusers
AutoencoderTiny layout (`config.json` + `diffusion_pytorch_model.safetensors`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ...resources import weights_dir
from ..hub_files import OFFLINE_HINT, HubFiles, require_repo_id
from ..weights_io import StateDict, WeightsError, from_diffusers, read_state_dict, state_differences
from .architecture import VARIANTS, Architecture, build_decoder, build_encoder

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_CONFIG = "config.json"
BUNDLED_DIR = weights_dir()  # weights/ of a checkout, taesd_fast/_weights of an install
BUNDLED_DEFAULT = "taef2"  # the real TAEF2 weights shipped with the package (MIT, madebyollin/taesd)


@dataclass
class LoadedWeights:
    encoder: StateDict | None
    decoder: StateDict | None
    name_hint: str | None  # a variant name found in the repo id, folder or file names
    origins: dict[str, str] = field(default_factory=dict)  # part -> the file or folder it came from, for messages
    config: dict = field(default_factory=dict)  # the diffusers config.json, when the source has one

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(self.origins.values()))


# Variants published on the Hub in the diffusers layout; the others' weights are .pth files in the GitHub repo.
HUB_REPOS = {v: f"madebyollin/{v}" for v in ("taesd", "taesdxl", "taesd3", "taef1")}
UPSTREAM_FILES = "github.com/madebyollin/taesd"


def weights_hint(variant: str, cli: bool = False) -> str:
    """How to load `variant`'s weights, spelled for the Python API or (cli=True) for the taesd-fast command."""
    if variant == BUNDLED_DEFAULT:
        return "the bundled default weights (no --weights)" if cli else "TAESD.from_pretrained() (bundled)"
    if variant in HUB_REPOS:
        return f"--weights {HUB_REPOS[variant]}" if cli else f"TAESD.from_pretrained({HUB_REPOS[variant]!r})"
    where = f"a folder holding {variant}_encoder.pth / {variant}_decoder.pth from {UPSTREAM_FILES}"
    return (f"--weights FOLDER --variant {variant}, with FOLDER {where}" if cli
            else f"TAESD.from_pretrained(FOLDER, variant={variant!r}), with FOLDER {where}")


def variant_hint(*names: str | os.PathLike | None) -> str | None:
    """The longest known variant name contained in any of the given names ('taesdxl' beats 'taesd')."""
    found = [v for n in names if n for v in VARIANTS if v in Path(str(n)).name.lower()]
    return max(found, key=len) if found else None


def _upstream_file_candidates(stem: str) -> list[tuple[str, str]]:
    return [(f"{stem}_encoder{ext}", f"{stem}_decoder{ext}") for ext in (".safetensors", ".pth")]


def load_from_files(encoder_path=None, decoder_path=None) -> LoadedWeights:
    enc = read_state_dict(encoder_path) if encoder_path else None
    dec = read_state_dict(decoder_path) if decoder_path else None
    origins = {part: str(path) for part, path in (("encoder", encoder_path), ("decoder", decoder_path)) if path}
    return LoadedWeights(enc, dec, variant_hint(encoder_path, decoder_path), origins)


def load_from_folder(folder: Path, load_encoder: bool, load_decoder: bool, variant: str | None = None) -> LoadedWeights:
    """Upstream files of one variant, or a diffusers-layout folder. A folder with several variants' files gives the
    one named by `variant`, else by the folder's name, else the one variant whose files include every part asked
    for; anything else is ambiguous and an error."""
    folder = Path(folder)
    if (folder / DIFFUSERS_WEIGHTS).is_file():
        return _load_diffusers(folder, load_encoder, load_decoder)
    wanted = [part for part, want in (("encoder", load_encoder), ("decoder", load_decoder)) if want]
    found = {stem: files for stem in VARIANTS if (files := _variant_files(folder, stem, wanted))}
    hint = variant_hint(folder)
    if variant is not None:
        if variant not in found:
            raise FileNotFoundError(f"no {variant} weights in {folder}: expected {variant}_encoder/_decoder "
                                    f".safetensors/.pth files" + (f" (found: {', '.join(found)})" if found else ""))
        stem = variant
    elif hint in found:
        stem = hint
    else:
        complete = [v for v, files in found.items() if len(files) == len(wanted)]
        choices = complete or list(found)
        if not choices:
            raise FileNotFoundError(f"no TAESD weights in {folder}: expected {DIFFUSERS_WEIGHTS} (+ {DIFFUSERS_CONFIG}) "
                                    "or <variant>_encoder/_decoder .safetensors/.pth files (variant one of "
                                    + ", ".join(VARIANTS) + ")")
        if len(choices) > 1:
            raise ValueError(f"{folder} holds weights of several TAESD variants ({', '.join(choices)}); "
                             "pass variant= to choose one")
        stem = choices[0]
    files = found[stem]
    return load_from_files(files.get("encoder"), files.get("decoder"))


def _variant_files(folder: Path, stem: str, parts: list[str]) -> dict[str, Path]:
    """{part: file} for the parts of `stem` present in folder (.safetensors preferred over .pth)."""
    files = {}
    for part in parts:
        for ext in (".safetensors", ".pth"):
            path = folder / f"{stem}_{part}{ext}"
            if path.is_file():
                files[part] = path
                break
    return files


def local_weights_files(name_or_path: str | os.PathLike | None) -> list[Path]:
    """The weights files that loading from `name_or_path` may read, for a local source: the bundled folder (None)
    or a folder's diffusers-layout files and every variant's upstream files (the ones `load_from_folder` would
    take). A Hub repo id gives none. The CLI counts these as inputs that no output may replace."""
    folder = BUNDLED_DIR if name_or_path is None else Path(name_or_path)
    if not folder.is_dir():
        return []
    diffusers = [folder / name for name in (DIFFUSERS_WEIGHTS, DIFFUSERS_CONFIG) if (folder / name).is_file()]
    return diffusers + [path for stem in VARIANTS for path in _variant_files(folder, stem, ["encoder", "decoder"]).values()]


def _load_diffusers(folder: Path, load_encoder: bool, load_decoder: bool) -> LoadedWeights:
    encoder, decoder = from_diffusers(read_state_dict(folder / DIFFUSERS_WEIGHTS))
    hint = variant_hint(folder)
    config_path = folder / DIFFUSERS_CONFIG
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") not in (None, "AutoencoderTiny"):
        raise WeightsError(f"{config_path} describes a {config['_class_name']}, not an AutoencoderTiny")
    return LoadedWeights(encoder if load_encoder else None, decoder if load_decoder else None, hint,
                         {"encoder": str(folder), "decoder": str(folder)},
                         config)


def load_from_hub(repo_id: str, *, load_encoder: bool, load_decoder: bool, variant: str | None = None, revision=None,
                  cache_dir=None, local_files_only: bool = False, subfolder: str | None = None) -> LoadedWeights:
    """Download (or find in the huggingface_hub cache) the files of a repo and load them.

    Tries the diffusers layout first, then upstream files named after `variant` or the repo. `HF_HUB_OFFLINE=1` is
    honoured by huggingface_hub itself.
    """
    files = HubFiles(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                     subfolder=subfolder)
    weights = files.get(DIFFUSERS_WEIGHTS)
    if weights is not None:
        files.get(DIFFUSERS_CONFIG, record=False)  # optional, validated when present
        loaded = _load_diffusers(weights.parent, load_encoder, load_decoder)
        loaded.name_hint = variant_hint(repo_id)
        return loaded
    stem = variant or variant_hint(repo_id) or repo_id.split("/")[-1].lower()
    for enc_name, dec_name in _upstream_file_candidates(stem):
        enc = files.get(enc_name) if load_encoder else None
        dec = files.get(dec_name) if load_decoder else None
        if (enc or not load_encoder) and (dec or not load_decoder):
            loaded = load_from_files(enc, dec)
            loaded.name_hint = variant_hint(repo_id)
            return loaded
    repo = (f"repo '{repo_id}'" + (f" (subfolder '{subfolder}')" if subfolder else "")
            + (f" at revision '{revision}'" if revision else ""))
    tried, unreachable = ", ".join(files.tried), files.unreachable
    if unreachable is not None:
        raise FileNotFoundError(
            f"could not reach the Hugging Face Hub for {repo} ({files.unreachable_reason()}), and the local "
            f"huggingface_hub cache has no TAESD weights for it; tried: {tried}. Check the network; {OFFLINE_HINT}."
        )
    where = "in the local huggingface_hub cache (offline mode)" if files.offline else "on the Hub or in the local cache"
    raise FileNotFoundError(
        f"could not find TAESD weights for {repo} {where}; tried: {tried}."
        + (" Download them once while online, or pass local paths." if files.offline else "")
    )


def resolve(name_or_path: str | os.PathLike | None, *, encoder_path=None, decoder_path=None, load_encoder=True,
            load_decoder=True, **hub_kwargs) -> LoadedWeights:
    """Find and read the state dicts for any accepted source."""
    if encoder_path is not None or decoder_path is not None:
        if name_or_path is not None:
            raise ValueError("pass either name_or_path or encoder_path/decoder_path, not both")
        return load_from_files(encoder_path, decoder_path)
    variant = known_variant(hub_kwargs.get("variant"))
    if name_or_path is None:
        if variant not in (None, BUNDLED_DEFAULT):
            raise FileNotFoundError(f"only {BUNDLED_DEFAULT} weights are bundled; for {variant}, load "
                                    + weights_hint(variant))
        return load_from_folder(BUNDLED_DIR, load_encoder, load_decoder, variant)
    path = Path(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in VARIANTS and not path.exists():
        return _load_variant(name_or_path, variant, load_encoder, load_decoder, hub_kwargs)
    if path.is_dir():  # a local copy of a repo: subfolder means the same as on the Hub
        return load_from_folder(path / (hub_kwargs.get("subfolder") or ""), load_encoder, load_decoder, variant)
    if path.is_file():
        raise ValueError(f"{path} is a single file: pass encoder_path= and/or decoder_path= instead")
    return load_from_hub(require_repo_id(name_or_path), load_encoder=load_encoder, load_decoder=load_decoder, **hub_kwargs)


def _load_variant(name: str, variant: str | None, load_encoder: bool, load_decoder: bool, hub_kwargs: dict):
    """A bare variant name, as TAEHV takes them: the bundled weights for taef2, the Hub repo for the others that
    have one, else a one-line error saying where the files are."""
    if variant not in (None, name):
        raise ValueError(f"from_pretrained({name!r}, variant={variant!r}): the name is a variant already; give one")
    if name == BUNDLED_DEFAULT:
        return load_from_folder(BUNDLED_DIR, load_encoder, load_decoder, name)
    if name in HUB_REPOS:
        return load_from_hub(HUB_REPOS[name], load_encoder=load_encoder, load_decoder=load_decoder,
                             **dict(hub_kwargs, variant=name))
    raise FileNotFoundError(f"{name}'s weights are on no Hub repo and not bundled; load them with "
                            + weights_hint(name))


def _differences(arch: Architecture, part: str, state: StateDict) -> dict[str, list[str]]:
    """What differs between `state` and `arch`'s encoder/decoder: {kind of difference: keys}, empty when it fits."""
    return state_differences(state, build_encoder if part == "encoder" else build_decoder, arch)


def _architecture_mismatch(arch: Architecture, part: str, state: StateDict) -> str | None:
    """None when `state` fits `arch`'s encoder/decoder exactly, else what differs."""
    differences = _differences(arch, part, state)
    if not differences:
        return None
    return "; ".join(f"{len(items)} {label} (e.g. {', '.join(items[:3])})" for label, items in differences.items())


def detect_architecture(loaded: LoadedWeights) -> Architecture:
    """The architecture the tensors describe. Raises, saying what does not fit, if they fit none of the published
    ones or encoder and decoder come from different ones."""
    parts = [(p, s) for p, s in (("encoder", loaded.encoder), ("decoder", loaded.decoder)) if s is not None]
    if not parts:
        raise WeightsError("no encoder or decoder weights were loaded")
    candidates = list(dict.fromkeys(VARIANTS.values()))
    fits = {p: [a for a in candidates if not _differences(a, p, s)] for p, s in parts}
    common = [a for a in candidates if all(a in fits[p] for p, _ in parts)]
    if common:
        return common[0]
    origin = {p: loaded.origins.get(p, "the given source") for p, _ in parts}
    for part, state in parts:
        if fits[part]:
            continue
        other = "decoder" if part == "encoder" else "encoder"
        swapped = [a for a in candidates if not _differences(a, other, state)]
        if swapped:
            raise WeightsError(f"the {part} weights from {origin[part]} are {other} weights (they fit a TAESD {other} "
                               f"with {swapped[0].describe()}); were the encoder and decoder files swapped?")
        closest = min(candidates, key=lambda a: _mismatch_count(a, part, state))
        raise WeightsError(
            f"the {part} weights from {origin[part]} match no published TAESD architecture (tried "
            f"{'; '.join(a.describe() for a in candidates)}); against the closest, {closest.describe()}: "
            f"{_architecture_mismatch(closest, part, state)}"
        )
    described = " but ".join(f"the {p} weights from {origin[p]} fit {' / '.join(a.describe() for a in fits[p])}"
                             for p, _ in parts)
    raise WeightsError(f"{described}: the encoder and decoder come from different TAESD variants")


def _mismatch_count(arch: Architecture, part: str, state: StateDict) -> int:
    return sum(len(items) for items in _differences(arch, part, state).values())


def known_variant(name: str | None) -> str | None:
    """name, when it is None or a published variant's name; else a ValueError listing them."""
    if name is not None and name not in VARIANTS:
        raise ValueError(f"unknown TAESD variant {name!r}; expected one of {', '.join(VARIANTS)}")
    return name


def check_variant(arch: Architecture, variant: str | None, loaded: LoadedWeights) -> str:
    """Pick the variant name: the requested one or the hint must agree with the tensors."""
    for name, origin in ((variant, "requested variant"), (loaded.name_hint, "name")):
        if known_variant(name) is None:
            continue
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
