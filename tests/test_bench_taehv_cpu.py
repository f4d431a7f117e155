"""The taehv benchmark section on the CPU: its plain PyTorch peer computes the same function as TAEHV (so the
GPU rows compare like with like, and its fp32 run is a valid reference), its rule that a wrong fast path posts no
time, and its refusal to run without CUDA."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import rel_err

from taesd_fast.apps.bench import cli as bench
from taesd_fast.apps.bench.taehv import (WORKLOADS, PlainTAEHVDecoder, decoder_flop, plain_decoder_like, random_decoder,
                                    require_cuda, section, withhold_if_wrong)

# fp32 CPU convs in two different orders (TAEHV runs TGrow before the upsample and fuses ReLUs): ~1e-7 in practice;
# a wrong index, shift or stride gives O(1) errors.
REL_TOL = 1e-5


@pytest.fixture(scope="module", params=["taew2_2", "taew2_1"])
def pair(request):
    model = random_decoder(request.param, seed=3)
    return model, plain_decoder_like(model)


def _latents(model, frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, frames, model.latent_channels, 3, 5, generator=torch.Generator().manual_seed(seed))


def test_plain_decoder_has_the_published_keys(pair):
    model, plain = pair
    ours = {k: tuple(v.shape) for k, v in model.decoder.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in plain.state_dict().items()} == ours
    # The weights really are the model's (a zero or default-initialised peer would also have the right keys).
    for key, value in model.decoder.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_plain_decoder_equals_taehv(pair):
    model, plain = pair
    latents = _latents(model, 3)
    with torch.no_grad():
        expected = model.decode_video(latents)
        got = plain(latents)
        untrimmed = plain(latents, trim=False)
    assert got.shape == expected.shape == (1, 4 * 3 - 3, 3, 3 * 8 * model.patch_size, 5 * 8 * model.patch_size)
    inside = ((expected > 0) & (expected < 1)).double().mean().item()
    assert inside > 0.5, f"only {inside:.0%} of pixels inside (0, 1): the comparison would be weak"
    assert rel_err(got, expected) <= REL_TOL
    assert untrimmed.shape[1] == 12 and torch.equal(untrimmed[:, 3:], got)


def test_chunked_decode_equals_whole(pair):
    """The fp32 reference decodes long clips in chunks of latent frames, carrying each MemBlock's last input."""
    model, plain = pair
    latents = _latents(model, 5, seed=1)
    with torch.no_grad():
        whole = plain(latents)
        chunked = plain.decode_in_chunks(latents, chunk=2)
        without_memory = plain(latents[:, 2:4], trim=False)  # latents 2, 3 as if the video started there
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    # The carried memory matters (so the test above could fail): latents 2, 3 give whole frames 5..12.
    assert not torch.allclose(without_memory, whole[:, 5:13], atol=1e-3)


def test_plain_decoder_runs_channels_last(pair):
    model, plain = pair
    latents = _latents(model, 2, seed=2)
    cl = PlainTAEHVDecoder(model.latent_channels, model.patch_size).to(memory_format=torch.channels_last)
    cl.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(cl(latents), plain(latents), rtol=0, atol=1e-5)


def test_clip_workload_is_about_10_tflop():
    """The issue's figure for a 121-frame 704x1280 taew2_2 decode (~10 TFLOP), so TFLOP/s columns mean that."""
    clip = WORKLOADS[0]
    plain = plain_decoder_like(random_decoder(clip.variant))
    flop = decoder_flop(plain, (1, clip.latent_frames, plain.latent_channels, clip.height, clip.width))
    assert 9e12 < flop < 11e12


def test_wrong_fast_path_posts_no_time():
    ok = withhold_if_wrong({"ms": 1.0, "fps": 4.0, "TFLOP/s": 9.0, "rel err vs fp32": 1e-3}, torch_fp16_err=6e-4)
    assert ok["ms"] == 1.0 and "note" not in ok
    for err in (2e-3, float("nan")):
        bad = withhold_if_wrong({"ms": 1.0, "fps": 4.0, "TFLOP/s": 9.0, "rel err vs fp32": err}, torch_fp16_err=6e-4)
        assert bad["ms"] is None and bad["fps"] is None and bad["TFLOP/s"] is None
        assert bad["note"].startswith("WRONG OUTPUT")


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as info:
        require_cuda()
    assert "\n" not in str(info.value) and "CUDA" in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--sections", "taehv"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA" in err


def test_workload_filter_names_the_choices():
    with pytest.raises(SystemExit, match="matches no taehv workload.*taew2_2 step"):
        section(argparse.Namespace(workloads="nonesuch", no_compile=True))


def test_section_dry_run_on_cpu(monkeypatch, capsys):
    """The section's whole orchestration (setup, references, every row, the stream peak, a torch.compile that
    fails, the table) on tiny workloads, with the CUDA-only calls stubbed: the GPU run is one device call, so a
    slip in this code must show here first. Timing is stubbed (1 ms per call); errors are real."""
    import taesd_fast.apps.bench.taehv as bt

    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    # float32 throughout (CPU float16 convs take seconds even at this size); the checks then see rounding noise.
    monkeypatch.setattr(torch.Tensor, "half", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "half", lambda self, *a, **k: self)
    monkeypatch.setattr(bt, "require_cuda", lambda: None)
    monkeypatch.setattr(bt, "_graph_of", lambda fn: fn)
    monkeypatch.setattr(bt, "time_ms", lambda fn: (fn(), 1.0)[1])

    def no_compile(*args, **kwargs):
        raise RuntimeError("torch.compile is not available here\nsecond line")

    monkeypatch.setattr(torch, "compile", no_compile)
    monkeypatch.setattr(bt, "STREAM_PEAK_STEPS", (2, 3))
    tiny = [bt.Workload("taew2_1 clip", "taew2_1", 3, 1, 2), bt.Workload("taew2_2 step", "taew2_2", 1, 1, 2, True)]
    rows = bt.bench_taehv(tiny, compile_modes=("default",))
    printed = capsys.readouterr().out
    by_method = {(r["workload"], r["method"]): r for r in rows}
    for work in tiny:
        assert by_method[(work.name, "PyTorch eager NCHW")]["ms"] == 1.0
        assert by_method[(work.name, "torch.compile default")]["note"] == \
            "failed: RuntimeError: torch.compile is not available here"
        ours = [r for r in rows if r["workload"] == work.name and r["method"].startswith("taesd_fast decode")]
        assert ours and all(r["rel err vs fp32"] < 1e-5 for r in ours if "rel err vs fp32" in r)
        assert all(r.get("ms") == 1.0 for r in ours if "rel err vs fp32" in r)
        assert f"{work.name} | PyTorch eager channels_last" in printed
    assert by_method[("taew2_1 clip", "taesd_fast decode_video")]["fps"] == 9 * 1000.0  # 4 * 3 - 3 frames
    assert by_method[("taew2_2 step", "taesd_fast decode_step (graph replay)")]["fps"] == 4 * 1000.0
    assert "bounded" in by_method[("taew2_2 step", "taesd_fast decode_step stream peak")]["note"]
    assert "taew2_1 clip" in bench.format_rows("taehv", rows)
