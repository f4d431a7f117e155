"""Every way of pointing at the same TAEF2 weights gives the same tensors and the same outputs.

Sources: the real .pth files, upstream .safetensors, a diffusers AutoencoderTiny folder, a local folder of upstream
files, and a huggingface_hub cache (upstream files, .pth files, diffusers layout, a diffusers subfolder) reached by
repo id with local_files_only=True or with HF_HUB_OFFLINE=1. The machine has no network, so the download call itself
is checked with a mock.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import populate_hub_cache
from safetensors.torch import load_file, save_file

from taesd_fast import TAESD
from taesd_fast.models.weights_io import from_diffusers, state_differences, to_diffusers

REPO = "madebyollin/taef2"

DIFFUSERS_CONFIG = {
    "_class_name": "AutoencoderTiny",
    "_diffusers_version": "0.32.0",
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 32,
    "encoder_block_out_channels": [64, 64, 64, 64],
    "decoder_block_out_channels": [64, 64, 64, 64],
    "num_encoder_blocks": [1, 3, 3, 3],
    "num_decoder_blocks": [3, 3, 3, 1],
    "act_fn": "relu",
    "upsample_fn": "nearest",
    "upsampling_scaling_factor": 2,
    "latent_magnitude": 3,
    "latent_shift": 0.5,
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
    "force_upcast": False,
}


@pytest.fixture(scope="module")
def upstream(taef2_encoder_pth, taef2_decoder_pth) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "encoder": torch.load(taef2_encoder_pth, map_location="cpu", weights_only=True),
        "decoder": torch.load(taef2_decoder_pth, map_location="cpu", weights_only=True),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory, upstream, taef2_encoder_pth, taef2_decoder_pth) -> dict[str, Path]:
    """The real weights converted to every format, each in its own folder."""
    root = tmp_path_factory.mktemp("formats")
    st = root / "upstream_safetensors"
    pth = root / "upstream_pth"
    diffusers = root / "diffusers"
    for d in (st, pth, diffusers):
        d.mkdir()
    for part in ("encoder", "decoder"):
        save_file({k: v.contiguous() for k, v in upstream[part].items()}, str(st / f"taef2_{part}.safetensors"))
    shutil.copyfile(taef2_encoder_pth, pth / "taef2_encoder.pth")
    shutil.copyfile(taef2_decoder_pth, pth / "taef2_decoder.pth")
    save_file(to_diffusers(upstream["encoder"], upstream["decoder"]), str(diffusers / "diffusion_pytorch_model.safetensors"))
    (diffusers / "config.json").write_text(json.dumps(DIFFUSERS_CONFIG, indent=2))
    return {"safetensors": st, "pth": pth, "diffusers": diffusers, "root": root}


@pytest.fixture(scope="module")
def reference_model(taef2_encoder_pth, taef2_decoder_pth) -> TAESD:
    return TAESD.from_pretrained(encoder_path=taef2_encoder_pth, decoder_path=taef2_decoder_pth)


@pytest.fixture(scope="module")
def probe():
    gen = torch.Generator().manual_seed(7)
    return torch.rand(2, 3, 48, 64, generator=gen), torch.randn(2, 32, 6, 8, generator=gen) * 2


def assert_same_model(model: TAESD, reference: TAESD, probe) -> None:
    assert model.variant == "taef2"
    for part in ("encoder", "decoder"):
        got, want = getattr(model, part).state_dict(), getattr(reference, part).state_dict()
        assert set(got) == set(want), part
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), f"{part} {key}"
    images, latents = probe
    with torch.no_grad():
        assert torch.equal(model.encode(images), reference.encode(images))
        assert torch.equal(model.decode(latents), reference.decode(latents))


# ------------------------------------------------------------------------------------------------- conversion


def test_to_diffusers_key_layout(upstream):
    """Encoder keys gain 'encoder.layers.'; decoder keys gain 'decoder.layers.' with the index shifted by -1."""
    state = to_diffusers(upstream["encoder"], upstream["decoder"])
    assert len(state) == len(upstream["encoder"]) + len(upstream["decoder"])
    # Written out by hand, so a wrong shift in both directions cannot cancel out.
    assert state["encoder.layers.0.weight"] is upstream["encoder"]["0.weight"]
    assert state["encoder.layers.13.pool.1.bias"] is upstream["encoder"]["13.pool.1.bias"]
    assert state["decoder.layers.0.weight"] is upstream["decoder"]["1.weight"]  # conv(latent, 64) after the clamp
    assert state["decoder.layers.2.pool.0.weight"] is upstream["decoder"]["3.pool.0.weight"]
    assert state["decoder.layers.18.bias"] is upstream["decoder"]["19.bias"]  # the final conv(64, 3)
    assert state["decoder.layers.0.weight"].shape == (64, 32, 3, 3)
    assert not any(k.startswith("decoder.layers.19.") for k in state)
    for key in upstream["decoder"]:
        index, rest = key.split(".", 1)
        assert state[f"decoder.layers.{int(index) - 1}.{rest}"] is upstream["decoder"][key]


def test_from_diffusers_inverts_to_diffusers(upstream):
    encoder, decoder = from_diffusers(to_diffusers(upstream["encoder"], upstream["decoder"]))
    assert encoder.keys() == upstream["encoder"].keys() and decoder.keys() == upstream["decoder"].keys()
    assert all(encoder[k] is upstream["encoder"][k] for k in encoder)
    assert all(decoder[k] is upstream["decoder"][k] for k in decoder)


def test_written_diffusers_file_holds_the_real_tensors(files, upstream):
    stored = load_file(str(files["diffusers"] / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(stored["decoder.layers.0.weight"], upstream["decoder"]["1.weight"])
    assert torch.equal(stored["encoder.layers.14.weight"], upstream["encoder"]["14.weight"])


# ----------------------------------------------------------------------------------------------- local sources


def test_explicit_safetensors_files(files, reference_model, probe):
    d = files["safetensors"]
    model = TAESD.from_pretrained(encoder_path=d / "taef2_encoder.safetensors", decoder_path=d / "taef2_decoder.safetensors")
    assert_same_model(model, reference_model, probe)


@pytest.mark.parametrize("kind", ["safetensors", "pth", "diffusers"])
def test_local_folder(files, reference_model, probe, kind):
    assert_same_model(TAESD.from_pretrained(files[kind]), reference_model, probe)
    assert_same_model(TAESD.from_pretrained(str(files[kind]), variant="taef2"), reference_model, probe)


def test_local_folder_with_subfolder(files, reference_model, probe):
    """A local copy of a pipeline repo: subfolder= picks the VAE folder, as it does on the Hub."""
    assert_same_model(TAESD.from_pretrained(files["root"], subfolder="diffusers"), reference_model, probe)


def test_folder_with_several_variants(tmp_path, taef2_encoder_pth, taef2_decoder_pth, taesana_encoder_pth):
    """A folder of downloads: the variant with every part asked for wins over a partial one; variant= picks; two
    complete variants are ambiguous."""
    folder = tmp_path / "downloads"
    folder.mkdir()
    for src in (taef2_encoder_pth, taef2_decoder_pth, taesana_encoder_pth):
        shutil.copyfile(src, folder / src.name)
    model = TAESD.from_pretrained(folder)
    assert model.variant == "taef2" and model.encoder is not None and model.decoder is not None
    sana = TAESD.from_pretrained(folder, variant="taesana")
    assert sana.variant == "taesana" and sana.decoder is None
    assert TAESD.from_pretrained(folder, variant="taef2").variant == "taef2"
    with pytest.raises(FileNotFoundError, match=r"no taesd weights in .*downloads.*\(found: taef2, taesana\)"):
        TAESD.from_pretrained(folder, variant="taesd")
    shutil.copyfile(taesana_encoder_pth, folder / "taesana_decoder.pth")  # a second complete pair (not a decoder)
    with pytest.raises(ValueError, match=r"holds weights of several TAESD variants \(taef2, taesana\); pass variant="):
        TAESD.from_pretrained(folder)


def test_local_folder_encoder_only_and_decoder_only(files, reference_model):
    enc_only = TAESD.from_pretrained(files["diffusers"], decoder=False)
    dec_only = TAESD.from_pretrained(files["safetensors"], encoder=False)
    assert enc_only.decoder is None and dec_only.encoder is None
    for key, value in reference_model.encoder.state_dict().items():
        assert torch.equal(enc_only.encoder.state_dict()[key], value)
    for key, value in reference_model.decoder.state_dict().items():
        assert torch.equal(dec_only.decoder.state_dict()[key], value)


def test_legacy_non_zip_pth_loads(tmp_path, upstream, reference_model, probe):
    """.pth files written by torch < 1.6 (or with _use_new_zipfile_serialization=False) are valid weights files."""
    paths = {}
    for part in ("encoder", "decoder"):
        paths[part] = tmp_path / f"taef2_{part}.pth"
        torch.save(upstream[part], paths[part], _use_new_zipfile_serialization=False)
    import zipfile

    assert not zipfile.is_zipfile(paths["encoder"])
    model = TAESD.from_pretrained(encoder_path=paths["encoder"], decoder_path=paths["decoder"])
    assert_same_model(model, reference_model, probe)


def test_dtype_and_device_arguments(files, reference_model):
    model = TAESD.from_pretrained(files["safetensors"], dtype=torch.float64, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    for key, value in reference_model.decoder.state_dict().items():
        assert torch.equal(model.decoder.state_dict()[key], value.double())


# --------------------------------------------------------------------------------------- huggingface_hub cache


@pytest.fixture(scope="module")
def hub_caches(tmp_path_factory, files, taef2_encoder_pth, taef2_decoder_pth) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    st, d = files["safetensors"], files["diffusers"]
    caches = {name: root / name for name in ("upstream", "pth", "diffusers", "subfolder")}
    populate_hub_cache(caches["upstream"], REPO, {f"taef2_{p}.safetensors": st / f"taef2_{p}.safetensors" for p in ("encoder", "decoder")})
    populate_hub_cache(caches["pth"], REPO, {"taef2_encoder.pth": taef2_encoder_pth, "taef2_decoder.pth": taef2_decoder_pth})
    populate_hub_cache(caches["diffusers"], REPO, {n: d / n for n in ("config.json", "diffusion_pytorch_model.safetensors")})
    # A pipeline repo (no variant in its name) with the VAE in a subfolder, at a non-default revision.
    populate_hub_cache(caches["subfolder"], "someone/flux2-pipeline",
                       {f"vae/{n}": d / n for n in ("config.json", "diffusion_pytorch_model.safetensors")},
                       revision="v1.0", commit="0123456789abcdef0123456789abcdef01234567")
    return caches


def test_fake_cache_is_recognised_by_huggingface_hub(hub_caches):
    """The hand-made layout is one huggingface_hub itself understands (guards the other tests' premise)."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    info = scan_cache_dir(hub_caches["upstream"])
    assert [r.repo_id for r in info.repos] == [REPO] and not info.warnings
    (revision,) = next(iter(info.repos)).revisions
    assert revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {"taef2_encoder.safetensors", "taef2_decoder.safetensors"}
    found = try_to_load_from_cache(REPO, "taef2_decoder.safetensors", cache_dir=hub_caches["upstream"])
    assert isinstance(found, str) and Path(found).is_file()


@pytest.mark.parametrize("layout", ["upstream", "pth", "diffusers"])
def test_hub_cache_local_files_only(hub_caches, reference_model, probe, no_network, layout):
    model = TAESD.from_pretrained(REPO, cache_dir=hub_caches[layout], local_files_only=True)
    assert_same_model(model, reference_model, probe)


@pytest.mark.parametrize("layout", ["upstream", "diffusers"])
def test_hub_cache_with_hf_hub_offline(hub_caches, reference_model, probe, no_network, hub_offline, layout):
    model = TAESD.from_pretrained(REPO, cache_dir=hub_caches[layout])
    assert_same_model(model, reference_model, probe)


def test_hub_default_cache_dir(hub_caches, reference_model, probe, no_network, monkeypatch):
    """Without cache_dir, huggingface_hub's configured cache (HF_HUB_CACHE) is used."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub_caches["upstream"]))
    assert_same_model(TAESD.from_pretrained(REPO, local_files_only=True), reference_model, probe)


def test_hub_cache_subfolder_and_revision(hub_caches, reference_model, probe, no_network):
    cache = hub_caches["subfolder"]
    for revision in ("v1.0", "0123456789abcdef0123456789abcdef01234567"):
        model = TAESD.from_pretrained("someone/flux2-pipeline", subfolder="vae", revision=revision, cache_dir=cache,
                                      local_files_only=True)
        assert_same_model(model, reference_model, probe)
    # the default revision 'main' was never cached: a clear miss, not a wrong model
    with pytest.raises(FileNotFoundError, match=r"someone/flux2-pipeline.*subfolder 'vae'.*diffusion_pytorch_model"):
        TAESD.from_pretrained("someone/flux2-pipeline", subfolder="vae", cache_dir=cache, local_files_only=True)


def test_all_sources_agree(files, hub_caches, reference_model, probe, no_network, taef2_encoder_pth, taef2_decoder_pth):
    """One table of every source, all compared with each other through the .pth reference."""
    st, pth = files["safetensors"], files["pth"]
    models = {
        "pth files": TAESD.from_pretrained(encoder_path=pth / "taef2_encoder.pth", decoder_path=pth / "taef2_decoder.pth"),
        "safetensors files": TAESD.from_pretrained(encoder_path=st / "taef2_encoder.safetensors",
                                                   decoder_path=st / "taef2_decoder.safetensors"),
        "diffusers folder": TAESD.from_pretrained(files["diffusers"]),
        "local folder": TAESD.from_pretrained(st),
        "bundled": TAESD.from_pretrained(),
        "hub cache upstream": TAESD.from_pretrained(REPO, cache_dir=hub_caches["upstream"], local_files_only=True),
        "hub cache diffusers": TAESD.from_pretrained(REPO, cache_dir=hub_caches["diffusers"], local_files_only=True),
    }
    images, latents = probe
    with torch.no_grad():
        want_z, want_x = reference_model.encode(images), reference_model.decode(latents)
        for name, model in models.items():
            assert torch.equal(model.encode(images), want_z), name
            assert torch.equal(model.decode(latents), want_x), name


# ------------------------------------------------------------------------------------------ mocked downloads


def _arg(call, name: str, position: int):
    """An argument of a recorded hf_hub_download call, whether passed by position or keyword."""
    return call.kwargs[name] if name in call.kwargs else call.args[position]


def _fake_download(available: dict[str, Path]):
    from huggingface_hub.errors import EntryNotFoundError

    def download(repo_id, filename, *, subfolder=None, revision=None, cache_dir=None, local_files_only=False, **kw):
        key = f"{subfolder}/{filename}" if subfolder else filename
        if key not in available:
            raise EntryNotFoundError(f"{key} not in {repo_id}")
        return str(available[key])

    return mock.Mock(side_effect=download)


def test_download_receives_revision_cache_dir_and_subfolder(files, reference_model, probe, tmp_path, hub_reachable):
    d = files["diffusers"]
    fake = _fake_download({f"vae/{n}": d / n for n in ("config.json", "diffusion_pytorch_model.safetensors")})
    with mock.patch("huggingface_hub.hf_hub_download", fake):
        model = TAESD.from_pretrained("someone/flux2-pipeline", subfolder="vae", revision="abc123", cache_dir=tmp_path)
    assert_same_model(model, reference_model, probe)
    assert fake.call_count >= 1
    for call in fake.call_args_list:
        assert _arg(call, "repo_id", 0) == "someone/flux2-pipeline"
        assert call.kwargs["subfolder"] == "vae"
        assert call.kwargs["revision"] == "abc123"
        assert Path(call.kwargs["cache_dir"]) == tmp_path
        assert call.kwargs["local_files_only"] is False
    assert _arg(fake.call_args_list[0], "filename", 1) == "diffusion_pytorch_model.safetensors"


def test_download_falls_back_to_upstream_files(files, reference_model, probe):
    st = files["safetensors"]
    fake = _fake_download({f"taef2_{p}.safetensors": st / f"taef2_{p}.safetensors" for p in ("encoder", "decoder")})
    with mock.patch("huggingface_hub.hf_hub_download", fake):
        model = TAESD.from_pretrained(REPO, local_files_only=True, revision="main")
    assert_same_model(model, reference_model, probe)
    requested = [_arg(c, "filename", 1) for c in fake.call_args_list]
    assert requested[0] == "diffusion_pytorch_model.safetensors"
    assert {"taef2_encoder.safetensors", "taef2_decoder.safetensors"} <= set(requested)
    assert all(c.kwargs["local_files_only"] is True and c.kwargs["subfolder"] is None for c in fake.call_args_list)


def test_unreachable_hub_is_reported_once_and_the_cache_still_searched(files, reference_model, probe, hub_reachable):
    """No network: the first lookup fails with a connection error; the rest must only search the cache (no minutes
    of retries per candidate file) and the error must say the Hub could not be reached, not that files are absent."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    st = files["safetensors"]
    cached = {f"taef2_{p}.safetensors": st / f"taef2_{p}.safetensors" for p in ("encoder", "decoder")}

    def download(repo_id, filename, *, local_files_only=False, **kw):
        if not local_files_only:
            raise LocalEntryNotFoundError("cannot find the requested files") from ConnectionError("DNS lookup failed")
        if filename not in cached:
            raise LocalEntryNotFoundError(f"{filename} not cached")
        return str(cached[filename])

    fake = mock.Mock(side_effect=download)
    with mock.patch("huggingface_hub.hf_hub_download", fake):
        with pytest.warns(UserWarning, match=r"cannot be reached .*using the cached copy.*HF_HUB_OFFLINE=1"):
            model = TAESD.from_pretrained(REPO)
        assert_same_model(model, reference_model, probe)  # found in the cache after all
        assert [c.kwargs["local_files_only"] for c in fake.call_args_list].count(False) == 1
        cached.clear()
        fake.reset_mock()
        with pytest.raises(FileNotFoundError, match=r"could not reach the Hugging Face Hub for repo .*\(ConnectionError: "
                           r"DNS lookup failed\).*no TAESD weights for it.*set HF_HUB_OFFLINE=1"):
            TAESD.from_pretrained(REPO)
        assert [c.kwargs["local_files_only"] for c in fake.call_args_list].count(False) == 1


def test_download_of_encoder_only_asks_for_no_decoder(files, hub_reachable):
    st = files["safetensors"]
    fake = _fake_download({"taef2_encoder.safetensors": st / "taef2_encoder.safetensors"})
    with mock.patch("huggingface_hub.hf_hub_download", fake):
        model = TAESD.from_pretrained(REPO, decoder=False)
    assert model.decoder is None and model.encoder is not None
    assert not any("decoder" in _arg(c, "filename", 1) for c in fake.call_args_list)


def test_state_differences_lists_each_kind_once_sorted():
    """The one key-and-shape comparison behind TAESD's and TAEHV's weight checks: missing, unexpected and
    mismatched keys against a module built on the meta device; nothing when the state fits."""
    build = lambda: torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))  # noqa: E731
    fits = {k: torch.zeros(v.shape) for k, v in build().state_dict().items()}
    assert state_differences(fits, build) == {}
    state = dict(fits, **{"1.bias": torch.zeros(5), "2.weight": torch.zeros(1)})
    del state["0.weight"]
    assert state_differences(state, build) == {
        "missing keys": ["0.weight"], "unexpected keys": ["2.weight"], "shape mismatches": ["1.bias: (5,) vs (4,)"]}
    assert state_differences({"weight": torch.zeros(4, 2), "bias": torch.zeros(4)}, torch.nn.Linear, 2, 4) == {}
