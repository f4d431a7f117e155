"""OutputHead (Wan 2.2 VAE decoder head) on CPU against an independent float64 formulation, and its loading paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import populate_hub_cache, rel_err
from safetensors.torch import save_file

from taesd_fast import OutputHead
from taesd_fast.models.weights_io import WeightsError

WAN_REPO = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
WAN_FILE = "vae/diffusion_pytorch_model.safetensors"
DIFFUSERS_KEYS = ("decoder.norm_out.gamma", "decoder.conv_out.weight", "decoder.conv_out.bias")
ORIGINAL_KEYS = ("decoder.head.0.gamma", "decoder.head.2.weight", "decoder.head.2.bias")


# ----------------------------------------------------------------------------------------- the reference


def unpatchify_by_hand(y: torch.Tensor, p: int = 2) -> torch.Tensor:
    """[B, C*p*p, T, H, W] -> [B, C, T, H*p, W*p]: channel c*p*p + r*p + q goes to pixel (h*p + q, w*p + r)."""
    b, cpp, t, h, w = y.shape
    out = y.new_full((b, cpp // (p * p), t, h * p, w * p), float("nan"))
    for c in range(cpp // (p * p)):
        for r in range(p):  # width offset
            for q in range(p):  # height offset
                out[:, c, :, q::p, r::p] = y[:, c * p * p + r * p + q]
    assert not out.isnan().any()
    return out


def reference_head(x, gamma, weight, bias, cache=None, patch_size=2) -> torch.Tensor:
    """Float64: RMS norm (L2 over channels * sqrt(C) * gamma) -> SiLU -> causal conv3d -> clamp -> unpatchify.

    cache: the activated frames in front of x (None: the first chunk, padded with 2 zero frames).
    """
    x = x.double()
    c = x.shape[1]
    norm = x / x.pow(2).sum(dim=1, keepdim=True).sqrt() * c**0.5 * gamma.double().reshape(1, c, 1, 1, 1)
    act = norm * torch.sigmoid(norm)
    if cache is None:
        act = F.pad(act, (0, 0, 0, 0, 2, 0))  # two zero frames in front, none behind
    else:
        act = torch.cat([cache.double(), act], dim=2)
    act = F.pad(act, (1, 1, 1, 1, 0, 0))  # spatial zero padding 1
    y = F.conv3d(act, weight.double(), bias.double()).clamp(-1, 1)
    return y if patch_size is None else unpatchify_by_hand(y, patch_size)


def random_head(c_in=64, c_out=12, seed=0, patch_size=2, dtype=torch.float32):
    """A head with random gamma (both signs), weights scaled so part of the output clamps, and random bias."""
    gen = torch.Generator().manual_seed(seed)
    head = OutputHead(c_in, c_out, patch_size=patch_size)
    with torch.no_grad():
        head.norm_out.gamma.copy_(torch.randn(c_in, 1, 1, 1, generator=gen) * 0.8 + 0.4)
        head.conv_out.weight.copy_(torch.randn(c_out, c_in, 3, 3, 3, generator=gen) * (2.0 / (27 * c_in) ** 0.5))
        head.conv_out.bias.copy_(torch.randn(c_out, generator=gen) * 0.3)
    return head.to(dtype).eval()


def random_features(b=1, c=64, t=3, h=5, w=7, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, c, t, h, w, generator=gen) * 2 + 0.3).to(dtype)


def params(head):
    return head.norm_out.gamma.detach(), head.conv_out.weight.detach(), head.conv_out.bias.detach()


# ----------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("c_in,b,t,h,w", [(64, 2, 3, 5, 7), (256, 1, 2, 6, 4), (32, 1, 1, 1, 1)])
def test_forward_matches_float64_reference(c_in, b, t, h, w):
    head = random_head(c_in)
    x = random_features(b, c_in, t, h, w)
    with torch.no_grad():
        video, cache = head(x)
    ref = reference_head(x, *params(head))
    assert video.shape == (b, 3, t, 2 * h, 2 * w) and video.dtype == torch.float32
    clamped = (ref.abs() == 1).double().mean().item()
    assert 0.005 < clamped < 0.5 or h * w == 1, f"{clamped:.1%} of outputs clamp: the test data is not telling"
    assert rel_err(video, ref) < 1e-5
    assert (video.double() - ref).abs().max() < 1e-5
    # The returned cache is the last two activated (normed, SiLU'd) frames, zero frames in front included.
    act = F.pad(reference_head_activation(x, head), (0, 0, 0, 0, 2, 0))
    torch.testing.assert_close(cache.double(), act[:, :, -2:], rtol=1e-5, atol=1e-6)


def reference_head_activation(x, head):
    gamma = head.norm_out.gamma.detach().double().reshape(1, -1, 1, 1, 1)
    x = x.double()
    norm = x / x.norm(dim=1, keepdim=True) * x.shape[1] ** 0.5 * gamma
    return F.silu(norm)


def test_patch_size_none_returns_conv_channels():
    head = random_head(32, patch_size=None)
    x = random_features(c=32, t=2)
    with torch.no_grad():
        out, _ = head(x)
    assert out.shape == (1, 12, 2, 5, 7)
    assert rel_err(out, reference_head(x, *params(head), patch_size=None)) < 1e-5


def test_float64_head():
    head = random_head(64, dtype=torch.float64)
    x = random_features(dtype=torch.float64)
    with torch.no_grad():
        out, _ = head(x)
    assert out.dtype == torch.float64
    # The RMS norm computes in float64 for float64 input (at least fp32 for any input): all float64 here.
    assert (out - reference_head(x, *params(head))).abs().max() < 1e-12


@pytest.mark.parametrize("chunks", [(1, 4, 4), (1, 4), (1, 1, 1, 2)])
def test_chunked_equals_unchunked(chunks):
    head = random_head(64)
    x = random_features(b=2, t=sum(chunks), seed=3)
    with torch.no_grad():
        whole, _ = head(x)
        outs, cache, start = [], None, 0
        for n in chunks:
            out, cache = head(x[:, :, start : start + n], cache)
            outs.append(out)
            start += n
    chunked = torch.cat(outs, dim=2)
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert rel_err(chunked, reference_head(x, *params(head))) < 1e-5
    # a fresh first chunk is not the same as a continuation: the cache matters
    with torch.no_grad():
        restarted, _ = head(x[:, :, chunks[0] : chunks[0] + chunks[1]])
    first = slice(chunks[0], chunks[0] + 1)
    assert restarted[:, :, :1].shape == whole[:, :, first].shape
    assert (restarted[:, :, :1] - whole[:, :, first]).abs().max() > 1e-2


def test_chunk_with_explicit_reference_cache():
    """After a 1-frame first chunk, the next chunk sees [zero frame, activated frame 0] in front of it."""
    head = random_head(64)
    x = random_features(t=5, seed=4)
    with torch.no_grad():
        _, cache = head(x[:, :, :1])
        out, _ = head(x[:, :, 1:], cache)
    first = reference_head_activation(x[:, :, :1], head)
    expected_cache = torch.cat([torch.zeros_like(first), first], dim=2)
    torch.testing.assert_close(cache.double(), expected_cache, rtol=1e-5, atol=1e-6)
    assert rel_err(out, reference_head(x[:, :, 1:], *params(head), cache=expected_cache)) < 1e-5


def test_forward_activated_equals_forward():
    head = random_head(64)
    x = random_features(b=2, t=3, seed=5)
    with torch.no_grad():
        direct, cache_a = head(x)
        activated = head.activate(x)
        via, cache_b = head.forward_activated(activated)
    assert torch.equal(direct, via) and torch.equal(cache_a, cache_b)
    torch.testing.assert_close(activated.double(), reference_head_activation(x, head), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------- unpatchify


def test_unpatchify_matches_einops_pattern():
    from einops import rearrange

    head = OutputHead(16, 12)
    gen = torch.Generator().manual_seed(6)
    y = torch.randn(2, 12, 3, 4, 5, generator=gen)
    expected = rearrange(y, "b (c r q) f h w -> b c f (h q) (w r)", q=2, r=2)
    assert torch.equal(head.unpatchify(y), expected)
    assert torch.equal(head.unpatchify(y), unpatchify_by_hand(y))


def test_unpatchify_places_each_channel_by_hand():
    """Without einops: a code identifying (channel, frame, h, w) must land at pixel (h*2 + q, w*2 + r)."""
    head = OutputHead(16, 12)
    t, h, w = 2, 3, 4
    ch, f, hh, ww = torch.meshgrid(torch.arange(12), torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    y = (1000 * ch + 100 * f + 10 * hh + ww + 1).float().unsqueeze(0)  # distinct, exactly representable
    out = head.unpatchify(y)
    assert out.shape == (1, 3, t, 2 * h, 2 * w)
    for c in range(3):
        for r in range(2):
            for q in range(2):
                for fi in range(t):
                    for hi in range(h):
                        for wi in range(w):
                            code = 1000 * (c * 4 + r * 2 + q) + 100 * fi + 10 * hi + wi + 1
                            assert out[0, c, fi, hi * 2 + q, wi * 2 + r].item() == code, (c, r, q, fi, hi, wi)
    # ... which is not pixel_shuffle's order (channel c*4 + q*2 + r at (h*2 + q, w*2 + r)).
    shuffled = F.pixel_shuffle(y[:, :, 0], 2)
    assert not torch.equal(out[:, :, 0], shuffled)


# ----------------------------------------------------------------------------------------------------- bf16


def test_bf16_error_within_twice_pytorch_bf16_error():
    """The head in bf16 is no worse than 2x a plain PyTorch bf16 computation of the same thing, both vs float64."""
    x32 = random_features(c=256, t=3, h=6, w=8, seed=9)
    try:
        head = random_head(256, seed=8, dtype=torch.bfloat16)
        x = x32.bfloat16()
        with torch.no_grad():
            out, _ = head(x)
    except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"bf16 conv3d unsupported on this CPU build: {err}")
    assert out.dtype == torch.bfloat16
    ref = reference_head(x, *params(head))  # float64 on the bf16-rounded inputs and weights
    # PyTorch's own bf16: norm in fp32 -> bf16, SiLU in bf16, conv3d in bf16, clamp.
    gamma, weight, bias = params(head)
    xf = x.float()
    norm = (F.normalize(xf, dim=1) * 256**0.5 * gamma.float()).bfloat16()
    act = F.pad(F.silu(norm), (1, 1, 1, 1, 2, 0))
    baseline = unpatchify_by_hand(F.conv3d(act, weight, bias).clamp(-1, 1))
    err_head = ((out.double() - ref).norm() / ref.norm()).item()
    err_torch = ((baseline.double() - ref).norm() / ref.norm()).item()
    print(f"bf16 head rel err {err_head:.2e}, PyTorch bf16 rel err {err_torch:.2e}")
    assert err_torch > 0  # bf16 rounding is visible, so the comparison means something
    assert err_head <= 2 * err_torch


# ------------------------------------------------------------------------------------------------- loading


def _head_tensors(c_in=64, seed=10):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.rand(c_in, 1, 1, 1, generator=gen) + 0.5,
        torch.randn(12, c_in, 3, 3, 3, generator=gen) * (1.5 / (27 * c_in) ** 0.5),
        torch.randn(12, generator=gen) * 0.2,
    )


def _unrelated(seed=11):
    gen = torch.Generator().manual_seed(seed)
    return {
        "decoder.up_blocks.0.resnets.0.conv1.weight": torch.randn(256, 256, 3, 3, 3, generator=gen),  # 7 MB
        "decoder.mid_block.attentions.0.to_qkv.weight": torch.randn(1024, 1024, generator=gen),  # 4 MB
        "encoder.conv_in.weight": torch.randn(160, 12, 3, 3, 3, generator=gen),
        "decoder.norm_out.bias_unused": torch.randn(256, generator=gen),
    }


@pytest.fixture
def diffusers_checkpoint(tmp_path):
    gamma, weight, bias = _head_tensors()
    state = dict(_unrelated())
    state.update(zip(DIFFUSERS_KEYS, (gamma, weight, bias)))
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(state, str(path))
    return path, (gamma, weight, bias)


def _check_loaded(head, tensors):
    gamma, weight, bias = tensors
    assert head.in_channels == weight.shape[1] and head.conv_out.out_channels == 12
    assert torch.equal(head.norm_out.gamma.detach().reshape(-1), gamma.reshape(-1))
    assert torch.equal(head.conv_out.weight.detach(), weight)
    assert torch.equal(head.conv_out.bias.detach(), bias)
    x = random_features(c=weight.shape[1], seed=12)
    with torch.no_grad():
        out, _ = head(x)
    assert rel_err(out, reference_head(x, gamma, weight, bias)) < 1e-5


class _SafeOpenSpy:
    """Wraps safetensors.safe_open and records which tensors are materialised."""

    calls: list[str] = []

    def __init__(self, real, *args, **kwargs):
        self._handle = real(*args, **kwargs)

    def __enter__(self):
        self._file = self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, key):
        _SafeOpenSpy.calls.append(key)
        return self._file.get_tensor(key)

    def get_slice(self, key):
        _SafeOpenSpy.calls.append(key)
        return self._file.get_slice(key)

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_from_pretrained_diffusers_safetensors_reads_only_head_tensors(diffusers_checkpoint, monkeypatch):
    import safetensors

    import taesd_fast.models.weights_io as weights_io

    path, tensors = diffusers_checkpoint
    real = safetensors.safe_open
    _SafeOpenSpy.calls = []
    spy = lambda *a, **k: _SafeOpenSpy(real, *a, **k)  # noqa: E731
    monkeypatch.setattr(safetensors, "safe_open", spy)
    monkeypatch.setattr(weights_io, "safe_open", spy, raising=False)
    head = OutputHead.from_pretrained(path)
    assert sorted(_SafeOpenSpy.calls) == sorted(DIFFUSERS_KEYS), _SafeOpenSpy.calls
    _check_loaded(head, tensors)


def test_from_pretrained_original_pth_layout(tmp_path):
    tensors = _head_tensors(c_in=32, seed=13)
    state = dict(_unrelated())
    state.update(zip(ORIGINAL_KEYS, tensors))
    path = tmp_path / "Wan2.2_VAE.pth"
    torch.save(state, path)
    _check_loaded(OutputHead.from_pretrained(path), tensors)


def test_from_pretrained_gamma_stored_flat(tmp_path):
    gamma, weight, bias = _head_tensors(seed=14)
    path = tmp_path / "flat.safetensors"
    save_file(dict(zip(DIFFUSERS_KEYS, (gamma.reshape(-1).contiguous(), weight, bias))), str(path))
    _check_loaded(OutputHead.from_pretrained(path), (gamma, weight, bias))


def test_from_pretrained_local_folder_with_subfolder(diffusers_checkpoint, tmp_path):
    path, tensors = diffusers_checkpoint
    repo = tmp_path / "wan_repo"
    (repo / "vae").mkdir(parents=True)
    path.rename(repo / "vae" / path.name)
    _check_loaded(OutputHead.from_pretrained(repo), tensors)


def test_from_pretrained_dtype(diffusers_checkpoint):
    path, tensors = diffusers_checkpoint
    head = OutputHead.from_pretrained(path, dtype=torch.float64, patch_size=None)
    assert head.conv_out.weight.dtype == torch.float64 and head.patch_size is None
    assert torch.equal(head.conv_out.weight.detach(), tensors[1].double())


def test_from_pretrained_hub_repo_through_faked_cache(diffusers_checkpoint, tmp_path, no_network):
    path, tensors = diffusers_checkpoint
    cache = tmp_path / "hub"
    populate_hub_cache(cache, WAN_REPO, {WAN_FILE: path})
    _check_loaded(OutputHead.from_pretrained(cache_dir=cache, local_files_only=True), tensors)


def test_from_pretrained_hub_repo_offline_env(diffusers_checkpoint, tmp_path, no_network, hub_offline):
    path, tensors = diffusers_checkpoint
    cache = tmp_path / "hub"
    populate_hub_cache(cache, WAN_REPO, {WAN_FILE: path}, revision="main")
    _check_loaded(OutputHead.from_pretrained(WAN_REPO, cache_dir=cache), tensors)


@pytest.mark.parametrize("how", ["local_files_only", "HF_HUB_OFFLINE"])
def test_offline_cache_miss_names_repo_and_file(tmp_path, no_network, monkeypatch, how):
    kwargs = {"cache_dir": tmp_path / "empty"}
    if how == "local_files_only":
        kwargs["local_files_only"] = True
    else:
        import huggingface_hub.constants as hf_constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError) as info:
        OutputHead.from_pretrained(**kwargs)
    message = str(info.value)
    assert WAN_REPO in message and WAN_FILE in message, message
    assert "offline" in message or "cache" in message


def test_checkpoint_without_head_tensors(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"decoder.conv_in.weight": torch.randn(4, 4)}, str(path))
    with pytest.raises(WeightsError, match=r"no Wan output-head tensors.*decoder\.norm_out\.gamma.*decoder\.head\.0\.gamma"):
        OutputHead.from_pretrained(path)


def test_checkpoint_with_wrong_conv_shape(tmp_path):
    gamma, weight, bias = _head_tensors()
    path = tmp_path / "bad.safetensors"
    save_file(dict(zip(DIFFUSERS_KEYS, (gamma, weight[:, :, :1].contiguous(), bias))), str(path))
    with pytest.raises(WeightsError, match=r"conv_out\.weight should be \[C_out, C_in, 3, 3, 3\].*\(12, 64, 1, 3, 3\)"):
        OutputHead.from_pretrained(path)


def test_forward_is_one_dispatched_head_full_call():
    """forward hands norm, SiLU, window, conv and unpatchify to the dispatcher as one call (a kernel may fuse all of
    it); on CPU that call runs PyTorch, recorded under conv_out with the cache flag of the chunk and the patch."""
    from taesd_fast import dispatch

    torch.manual_seed(3)
    head = OutputHead(16, 12)
    x = torch.randn(1, 16, 3, 5, 6)
    with torch.no_grad(), dispatch.backend("auto"):
        _, cache = head(x)
        head(torch.randn(1, 16, 2, 5, 6), cache)
    rows = [r for r in head.dispatch_table().splitlines() if r.startswith("conv_out")]
    assert len(rows) == 2 and all(" torch " in r for r in rows)
    assert "1x16x3x5x6" in rows[0] and "bias+unpatchify2 " in rows[0] and "bias+cache+unpatchify2 " in rows[1]
