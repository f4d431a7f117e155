"""TAEHV weights: the published variants, architecture detection from the tensors, and finding the file
(Hub through huggingface_hub, a local folder, or an explicit path).

A published file is one state dict with `encoder.<i>.…` and `decoder.<i>.…` keys (madebyollin/taehv's TAEHV
module). Everything that shapes the network is read from the tensors: latent channels, patch size, base or super
decoder, and each TPool / TGrow time stride. File names only break ties between variants whose tensors are
identical (taehv, taew2_1, taeos1_3 and taecvx all have 16 channels, patch 1, 4x time).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from ..hub_files import OFFLINE_HINT, HubFiles, require_repo_id
from ..weights_io import StateDict, WeightsError, read_state_dict, state_differences
from .layers import ENCODER_WIDTH, IMAGE_CHANNELS, TAEHVArch, build_decoder, build_encoder

HUB_REPO = "madebyollin/taehv"
_LTX = TAEHVArch(128, 4, encoder_time=(2, 2, 2), decoder_time=(2, 2, 2))
VARIANTS: dict[str, TAEHVArch] = {
    "taehv": TAEHVArch(16, 1),  # Hunyuan Video
    "taew2_1": TAEHVArch(16, 1),  # Wan 2.1, Wan 2.2 14B, Qwen Image
    "taeos1_3": TAEHVArch(16, 1),  # Open-Sora 1.3
    "taecvx": TAEHVArch(16, 1),  # CogVideoX (an even latent count is decoded untrimmed, as upstream does)
    "taew2_2": TAEHVArch(48, 2),  # Wan 2.2 TI2V 5B
    "taew2_2_super": TAEHVArch(48, 2, super_decoder=True),
    "taehv1_5": TAEHVArch(32, 2),  # Hunyuan Video 1.5
    "taehv1_5_super": TAEHVArch(32, 2, super_decoder=True),
    "taeltx_2": _LTX,  # LTX-2
    "taeltx2_3": _LTX,  # LTX-2.3
}
# Published but not supported here, recognised by their tensors so the error can say what they are.
_UNSUPPORTED = {(24, 2): "taeh3 (MiniMax H3: its 17-frame chunked encode and decode are not implemented here)"}
# Files tried, in order, for a variant in a Hub repo or a local folder (the GitHub repo keeps .pth files at the
# root and .safetensors under safetensors/).
FILE_PATTERNS = ("{v}.safetensors", "safetensors/{v}.safetensors", "{v}.pth")

# Index of each stage's TPool in the encoder, and of each TGrow in the base / super decoder.
_TPOOL = (2, 7, 12)
_TGROW = {False: (7, 13, 19), True: (7, 14, 21)}
_ENCODER_OUT, _DECODER_OUT = 17, 22


def known_variant(name: str | None) -> str | None:
    if name is not None and name not in VARIANTS:
        raise ValueError(f"unknown TAEHV variant {name!r}; expected one of {', '.join(VARIANTS)}")
    return name


def split_parts(state: StateDict, source: str) -> tuple[StateDict | None, StateDict | None]:
    """{'encoder.i.x': t, 'decoder.j.y': u} -> ({'i.x': t}, {'j.y': u}); a part absent from the file is None."""
    parts: dict[str, StateDict] = {"encoder": {}, "decoder": {}}
    for key, value in state.items():
        part, _, rest = key.partition(".")
        if part not in parts or not rest:
            raise WeightsError(f"{source}: unexpected key {key!r}; a TAEHV file holds encoder.* and decoder.* tensors")
        parts[part][rest] = value
    if not parts["encoder"] and not parts["decoder"]:
        raise WeightsError(f"{source} holds no tensors")
    return parts["encoder"] or None, parts["decoder"] or None


def _shape(state: StateDict, key: str, source: str) -> tuple:
    if key not in state:
        raise WeightsError(f"{source}: no tensor {key!r}, so this is not a TAEHV checkpoint in the published layout")
    return tuple(state[key].shape)


def _stride(out_or_in: int, width: int, what: str, source: str) -> int:
    if out_or_in % width or out_or_in // width not in (1, 2):
        raise WeightsError(f"{source}: {what} has {out_or_in} channels; expected {width} or {2 * width}")
    return out_or_in // width


def _patch(channels: int, source: str, what: str) -> int:
    patch = round((channels / IMAGE_CHANNELS) ** 0.5)
    if IMAGE_CHANNELS * patch * patch != channels:
        raise WeightsError(f"{source}: {what} has {channels} channels, not 3 x patch² for any patch size")
    return patch


def detect(encoder: StateDict | None, decoder: StateDict | None, source: str) -> TAEHVArch:
    """The architecture the tensors describe; a WeightsError naming what does not fit."""
    found: dict[str, TAEHVArch] = {}
    if encoder is not None:
        first = _shape(encoder, "0.weight", f"{source} (encoder)")
        latent = _shape(encoder, f"{_ENCODER_OUT}.weight", f"{source} (encoder)")[0]
        strides = tuple(_stride(_shape(encoder, f"{i}.conv.weight", source)[1], ENCODER_WIDTH,
                                f"encoder.{i} (TPool)", source) for i in _TPOOL)
        found["encoder"] = TAEHVArch(latent, _patch(first[1], source, "encoder.0"), encoder_time=strides)
    if decoder is not None:
        is_super = "0.weight" in decoder
        head = "0.weight" if is_super else "1.weight"
        latent = _shape(decoder, head, f"{source} (decoder)")[1]
        out = _shape(decoder, f"{_DECODER_OUT}.weight", f"{source} (decoder)")[0]
        strides = []
        for i in _TGROW[is_super]:
            rows, width = _shape(decoder, f"{i}.conv.weight", source)[:2]
            strides.append(_stride(rows, width, f"decoder.{i} (TGrow)", source))
        found["decoder"] = TAEHVArch(latent, _patch(out, source, f"decoder.{_DECODER_OUT}"), is_super,
                                     decoder_time=tuple(strides))
    if "encoder" in found and "decoder" in found:
        enc, dec = found["encoder"], found["decoder"]
        if (enc.latent_channels, enc.patch_size) != (dec.latent_channels, dec.patch_size):
            raise WeightsError(f"{source}: the encoder ({enc.latent_channels} latent channels, patch {enc.patch_size}) "
                               f"and decoder ({dec.latent_channels}, patch {dec.patch_size}) do not belong together")
        arch = replace(dec, encoder_time=enc.encoder_time)
    else:
        arch = found.get("decoder") or found["encoder"]
    unsupported = _UNSUPPORTED.get((arch.latent_channels, arch.patch_size))
    if unsupported:
        raise WeightsError(f"{source} holds {unsupported}")
    for part, state in (("encoder", encoder), ("decoder", decoder)):
        if state is not None:
            check_fits(arch, part, state, source)
    return arch


def check_fits(arch: TAEHVArch, part: str, state: StateDict, source: str) -> None:
    """Every key and shape of `state` must be those of `arch`'s encoder / decoder."""
    problems = state_differences(state, build_encoder if part == "encoder" else build_decoder, arch)
    if problems:
        detail = "; ".join(f"{len(v)} {label} (e.g. {', '.join(f'{part}.{x}' for x in v[:3])})"
                           for label, v in problems.items())
        raise WeightsError(f"{source}: the {part} tensors do not fit a TAEHV {part} with {arch.describe()}: {detail}")


def variant_hint(*names) -> str | None:
    """The longest known variant name that a file or folder name contains as a word ('taew2_2_super' beats
    'taew2_2'), else None."""
    found = [v for n in names if n for v in VARIANTS
             if re.search(rf"(^|[^a-z0-9]){re.escape(v)}($|[^a-z0-9_])", Path(str(n)).name.lower())]
    return max(found, key=len) if found else None


def choose_name(arch: TAEHVArch, requested: str | None, hint: str | None, source: str) -> str:
    """The variant name: the requested one (it must agree with the tensors), else the file name's when it agrees,
    else the first published variant with these tensors."""
    if known_variant(requested) is not None:
        want = VARIANTS[requested]
        if _name_key(want) != _name_key(arch):
            raise WeightsError(f"variant {requested!r} ({want.describe()}) disagrees with the weights in {source}, "
                               f"which have {arch.describe()}")
        return requested
    matching = [n for n, a in VARIANTS.items() if _name_key(a) == _name_key(arch)]
    if hint in matching:
        return hint
    if not matching:
        raise WeightsError(f"{source} holds a TAEHV with {arch.describe()}, which matches no published variant "
                           f"({', '.join(VARIANTS)})")
    return matching[0]


def _name_key(arch: TAEHVArch) -> tuple:
    """What a variant name must agree with: latent channels, patch size, base or super decoder."""
    return arch.latent_channels, arch.patch_size, arch.super_decoder


# ------------------------------------------------------------------------------------------- finding files


def resolve(name_or_path, *, variant: str | None, revision: str | None = None, cache_dir=None,
            local_files_only: bool = False) -> tuple[StateDict, str, str | None]:
    """(state dict, where it came from, a variant name the path suggests) for any accepted source:
    None or a variant name (the Hub repo madebyollin/taehv), a Hub repo id, a local folder, a weights file. An
    existing local path wins over a variant name or repo id that reads the same."""
    known_variant(variant)
    path = Path(name_or_path) if name_or_path is not None else None
    if path is not None and path.is_file():
        return read_state_dict(path), str(path), variant_hint(path)
    if path is not None and path.is_dir():
        return _from_folder(path, variant)
    if name_or_path is None or str(name_or_path) in VARIANTS:
        name = variant if name_or_path is None else str(name_or_path)
        if variant is not None and name != variant:
            raise ValueError(f"from_pretrained({name_or_path!r}, variant={variant!r}): two different variants")
        if name is None:
            raise ValueError("TAEHV.from_pretrained needs a variant name (e.g. 'taew2_2'), a Hub repo id, a folder "
                             f"or a file; variants: {', '.join(VARIANTS)}")
        return _from_hub(HUB_REPO, name, revision, cache_dir, local_files_only)
    repo_id = require_repo_id(name_or_path, example=HUB_REPO)
    stem = variant or variant_hint(repo_id)
    if stem is None:
        raise ValueError(f"which TAEHV variant from {repo_id}? pass variant= (one of {', '.join(VARIANTS)})")
    return _from_hub(repo_id, stem, revision, cache_dir, local_files_only)


def _folder_files(folder: Path, variant: str | None) -> dict[str, Path]:
    """{variant: its file in folder} (the first of FILE_PATTERNS present) for `variant`, or for every variant."""
    found = {}
    for name in [variant] if variant else list(VARIANTS):
        for pattern in FILE_PATTERNS:
            candidate = folder / pattern.format(v=name)
            if candidate.is_file():
                found[name] = candidate
                break
    return found


def local_weights_files(name_or_path, variant: str | None = None) -> list[Path]:
    """The weights files that loading from `name_or_path` may read, for a local source (a file, or a folder's
    variant files); a variant name or Hub repo id gives none. The CLI counts these as inputs that no output may
    replace."""
    path = Path(name_or_path) if name_or_path is not None else None
    if path is not None and path.is_file():
        return [path]
    if path is not None and path.is_dir():
        return list(_folder_files(path, variant).values())
    return []


def _from_folder(folder: Path, variant: str | None) -> tuple[StateDict, str, str | None]:
    found = _folder_files(folder, variant)
    if not found:
        wanted = " / ".join(p.format(v=variant or "<variant>") for p in FILE_PATTERNS)
        raise FileNotFoundError(f"no TAEHV weights in {folder}: expected {wanted}")
    if len(found) > 1:
        raise ValueError(f"{folder} holds several TAEHV variants ({', '.join(found)}); pass variant= to choose one")
    name, path = next(iter(found.items()))
    return read_state_dict(path), str(path), name


def _from_hub(repo_id: str, variant: str, revision, cache_dir, local_files_only: bool):
    """The first of FILE_PATTERNS present in the repo (or, offline, in the huggingface_hub cache)."""
    files = HubFiles(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    for pattern in FILE_PATTERNS:
        filename = pattern.format(v=variant)
        path = files.get(filename)
        if path is not None:
            return read_state_dict(path), f"{repo_id}/{filename}", variant
    where = f"repo '{repo_id}'" + (f" at revision '{revision}'" if revision else "")
    tried, unreachable, offline = files.tried, files.unreachable, files.offline
    if unreachable is not None:
        raise FileNotFoundError(f"could not reach the Hugging Face Hub for {where} ({files.unreachable_reason()}) and "
                                f"the local cache has none of {', '.join(tried)}; check the network; {OFFLINE_HINT}")
    mode = "in the local huggingface_hub cache (offline)" if offline else "on the Hub or in the local cache"
    raise FileNotFoundError(f"no {variant} weights for {where} {mode}; tried {', '.join(tried)}")
