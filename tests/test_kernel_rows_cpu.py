"""The kernel rows (taesd_fast/kernels/rows.py), on CPU: the table's shape, and each row's support rule, i.e. which
calls each kernel accepts and refuses. The expectations are the limits each kernel module's docstring states (the
README's rows table repeats them), checked on a pretend H200 (sm_90, 132 SMs): the rules ask the device for its
capability and SM count, which are patched here; everything else is the rule itself.

What runs where: the Triton rows' kernels run on CPU under Triton's interpreter in tests/test_conv_tc_cpu.py; the
Gluon, CUDA C++ and SIMT rows' kernels need an sm_90 GPU (tests/gpu/test_conv_rows_gpu.py). Here their launch
functions are checked to refuse what their rule refuses, with a ValueError naming the limit, before any launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taesd_fast.dispatch import Spec, table
from taesd_fast.kernels import rows
from taesd_fast.kernels.gluon_import import GLUON_ERROR

F16, BF16 = torch.float16, torch.bfloat16
CONV_ROWS = [r.name for r in rows.KERNEL_ROWS if r.kind == "conv2d"]
needs_gluon = pytest.mark.skipif(GLUON_ERROR is not None, reason=f"Gluon rows report its absence: {GLUON_ERROR}")


def conv(x_shape, c_out=None, stride=1, upsample=1, residual=False, pre_clamp=False, dtype=F16, bias=True,
         layout="channels_last", device="cuda:0", k=3) -> Spec:
    c_in = x_shape[1]
    return Spec("conv2d", device, tuple(x_shape), (c_out or c_in, c_in, k, k), dtype, stride, bias, residual, True,
                layout, upsample, pre_clamp)


def head_full(x_shape, c_out=12, cache=True, dtype=BF16, patch=0, device="cuda:0") -> Spec:
    return Spec("head_full", device, tuple(x_shape), (c_out, x_shape[1], 3, 3, 3), dtype, 1, True, cache, False,
                "nchw", patch=patch)


@pytest.fixture
def h200(monkeypatch):
    """Pretend the spec's device is an H200: sm_90, 132 SMs, Triton and NVRTC usable."""
    from taesd_fast.kernels import (conv_launch, cuda_conv_rows, cuda_conv_tiles, cuda_fused, gluon_conv_narrow,
                                    gluon_conv_up, gluon_fused, triton_conv, triton_conv_tma, triton_mem_conv)

    monkeypatch.setattr(conv_launch, "is_sm90", lambda device: True)
    monkeypatch.setattr(gluon_fused, "is_sm90", lambda device: True)
    monkeypatch.setattr(triton_conv_tma, "capability", lambda device: (9, 0))
    monkeypatch.setattr(triton_mem_conv, "capability", lambda device: (9, 0))
    monkeypatch.setattr(cuda_fused, "capability", lambda device: (9, 0))
    for m in (gluon_conv_up, gluon_conv_narrow):
        monkeypatch.setattr(m, "sm_count", lambda device: 132)
    for m in (triton_conv, triton_conv_tma, triton_mem_conv):
        monkeypatch.setattr(m, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(cuda_fused, "_failure", [])
    monkeypatch.setattr(cuda_conv_rows, "_failure", [])
    monkeypatch.setattr(cuda_conv_tiles, "_failure", [])


def why(name: str, spec: Spec) -> str | None:
    return table.row(spec.kind, name).supports(spec)


# --------------------------------------------------------------------------- the table


def test_table_lists_each_kernel_once_with_its_module_functions():
    seen = set()
    for r in rows.KERNEL_ROWS:
        assert (r.kind, r.name) not in seen, r.name
        seen.add((r.kind, r.name))
        assert r.kind in ("conv2d", "mem_conv", "head", "head_full") and r.layouts and isinstance(r.nvrtc, bool)
        assert (Path(__file__).resolve().parents[1] / "taesd_fast" / "kernels" / f"{r.module}.py").is_file()
        assert r.module == (r.name if not r.name.startswith("simt_f16_") else "simt_conv"), "a row lives in its module"
    assert CONV_ROWS == ["triton_conv", "triton_conv_tma", "gluon_conv_rows", "gluon_conv_tile", "gluon_conv_up",
                         "gluon_conv_narrow", "cuda_conv_rows", "cuda_conv_tiles", "cuda_conv_up", "cuda_conv_narrow",
                         "simt_f16_tile", "simt_f16_ocb4", "simt_f16_rb"]
    assert sorted(rows.DEFAULT_ORDER) == sorted({r.name for r in rows.KERNEL_ROWS})
    nchw_first = rows.forced_order("nchw")
    assert nchw_first[:3] == ("simt_f16_rb", "simt_f16_ocb4", "simt_f16_tile")  # NCHW inputs reach the SIMT convs
    assert rows.forced_order("channels_last")[0] == "gluon_conv_up"
    with pytest.raises(KeyError, match=r"no conv2d row named 'tc' \(have: \['torch', 'triton_conv'"):
        table.row("conv2d", "tc")


def test_cpu_specs_are_refused_without_importing_triton():
    """A CPU call must cost no Triton import (about a second): every row says "CPU tensor" first."""
    code = ("import sys, torch\n"
            "from taesd_fast.dispatch import Spec\n"
            "from taesd_fast.kernels.rows import KERNEL_ROWS\n"
            "conv = Spec('conv2d', 'cpu', (1, 64, 8, 8), (64, 64, 3, 3), torch.float16, 1, True, False, True, 'nchw')\n"
            "head = Spec('head', 'cpu', (1, 64, 6, 8, 8), (12, 64, 3, 3, 3), torch.bfloat16, 1, True, False, False, 'nchw')\n"
            "full = Spec('head_full', 'cpu', (1, 64, 4, 8, 8), (12, 64, 3, 3, 3), torch.bfloat16, 1, True, True, False, 'nchw')\n"
            "mem = Spec('mem_conv', 'cpu', (4, 64, 8, 8), (64, 128, 3, 3), torch.float16, 1, True, True, True, "
            "'nchw', frames=4)\n"
            "spec = {'conv2d': conv, 'mem_conv': mem, 'head': head, 'head_full': full}\n"
            "print(sorted({r.supports(spec[r.kind]) for r in KERNEL_ROWS}), 'triton' in sys.modules)\n")
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    reasons, triton_loaded = proc.stdout.rsplit(" ", 1)
    assert "CPU tensor" in reasons and triton_loaded.strip() == "False", proc.stdout


# --------------------------------------------------------------------------- conv rows' rules


def test_triton_conv_takes_every_contract_shape(h200):
    """The pointer kernel: f16, 3x3, 1..256 channels each way, stride 1 or 2, the upsample fold (stride 1), the soft
    clamp, any epilogue."""
    for spec in (conv((1, 3, 16, 16), 64, pre_clamp=True), conv((64, 64, 256, 256)), conv((1, 64, 9, 7), 3),
                 conv((2, 128, 8, 8), 160, stride=2), conv((1, 64, 32, 32), upsample=2, residual=True),
                 conv((1, 256, 4, 4), 256), conv((1, 64, 8, 8), layout="nchw")):
        assert why("triton_conv", spec) is None, spec
    assert "float16" in why("triton_conv", conv((1, 64, 8, 8), dtype=torch.float32))
    assert "3x3" in why("triton_conv", conv((1, 64, 8, 8), k=5))
    assert "1..256" in why("triton_conv", conv((1, 512, 8, 8), 64))
    assert "stride 3" in why("triton_conv", conv((1, 64, 8, 8), stride=3))
    assert "upsample=2 needs stride 1" in why("triton_conv", conv((1, 64, 8, 8), stride=2, upsample=2))


def test_triton_conv_tma_takes_stride_1_without_clamp_on_hopper(h200, monkeypatch):
    from taesd_fast.kernels import triton_conv_tma

    for spec in (conv((64, 64, 256, 256)), conv((1, 64, 16, 16), upsample=2), conv((1, 32, 9, 9), 64),
                 conv((1, 128, 8, 8), 160, residual=True), conv((1, 64, 8, 8), 3)):
        assert why("triton_conv_tma", spec) is None, spec
    assert "stride 2" in why("triton_conv_tma", conv((1, 64, 8, 8), stride=2))
    assert "pre_clamp" in why("triton_conv_tma", conv((1, 64, 8, 8), pre_clamp=True))
    assert "C_in=3 must be >= 16" in why("triton_conv_tma", conv((1, 3, 8, 8), 64))
    assert "multiple of block_k" in why("triton_conv_tma", conv((1, 48, 8, 8), 64))  # chunks of 64 channels
    monkeypatch.setattr(triton_conv_tma, "capability", lambda device: (8, 0))
    assert "Hopper" in why("triton_conv_tma", conv((1, 64, 8, 8)))


@needs_gluon
def test_gluon_conv_rows_takes_64_to_64_and_narrow_outputs(h200):
    for spec in (conv((64, 64, 256, 256), residual=True), conv((1, 64, 512, 512)), conv((2, 64, 64, 64), 3),
                 conv((1, 64, 100, 100), 16)):
        assert why("gluon_conv_rows", spec) is None, spec
    assert "64->32" in why("gluon_conv_rows", conv((1, 64, 64, 64), 32))
    assert "32->64" in why("gluon_conv_rows", conv((1, 32, 64, 64), 64))
    assert "with a residual" in why("gluon_conv_rows", conv((1, 64, 64, 64), 3, residual=True))
    for kw in ({"stride": 2}, {"upsample": 2}, {"pre_clamp": True}):
        assert "plain stride-1" in why("gluon_conv_rows", conv((1, 64, 64, 64), **kw)), kw
    assert "W=32" in why("gluon_conv_rows", conv((1, 64, 64, 32)))


@needs_gluon
def test_gluon_conv_tile_takes_64_to_64_from_16_columns(h200):
    for spec in (conv((1, 64, 32, 32), residual=True), conv((1, 64, 128, 128)), conv((1, 64, 5, 16)),
                 conv((64, 64, 256, 256))):  # large grids run in several waves: the timing decides
        assert why("gluon_conv_tile", spec) is None, spec
    assert "64->3" in why("gluon_conv_tile", conv((1, 64, 32, 32), 3))
    for kw in ({"stride": 2}, {"upsample": 2}, {"pre_clamp": True}):
        assert "plain stride-1" in why("gluon_conv_tile", conv((1, 64, 32, 32), **kw)), kw
    assert "W=8" in why("gluon_conv_tile", conv((1, 64, 32, 8)))


@needs_gluon
def test_gluon_conv_up_takes_small_upsample_folds_in_one_wave(h200):
    for spec in (conv((1, 64, 32, 32), upsample=2), conv((1, 64, 128, 128), upsample=2)):  # 64^2, 256^2 output
        assert why("gluon_conv_up", spec) is None, spec
    assert "more than one program per SM" in why("gluon_conv_up", conv((1, 64, 256, 256), upsample=2))  # 512^2
    assert "more than one program per SM" in why("gluon_conv_up", conv((16, 64, 32, 32), upsample=2))
    assert "plain upsample fold" in why("gluon_conv_up", conv((1, 64, 32, 32), upsample=2, residual=True))
    assert "plain upsample fold" in why("gluon_conv_up", conv((1, 64, 32, 32)))
    assert "64->32" in why("gluon_conv_up", conv((1, 64, 32, 32), 32, upsample=2))


@needs_gluon
def test_gluon_conv_narrow_takes_up_to_7_outputs_of_whole_rows(h200):
    for spec in (conv((1, 64, 256, 256), 3), conv((1, 64, 128, 128), 7), conv((1, 64, 32, 40), 1)):
        assert why("gluon_conv_narrow", spec) is None, spec
    assert "64->8" in why("gluon_conv_narrow", conv((1, 64, 32, 32), 8))
    assert "W=300" in why("gluon_conv_narrow", conv((1, 64, 8, 300), 3))
    assert "a residual" in why("gluon_conv_narrow", conv((1, 64, 32, 32), 3, residual=True))
    assert "more than one program per SM" in why("gluon_conv_narrow", conv((16, 64, 256, 256), 3))


def test_cuda_conv_rows_takes_64_to_64_wider_than_64(h200):
    from taesd_fast.kernels import cuda_conv_rows

    for spec in (conv((1, 64, 256, 256), residual=True), conv((1, 64, 128, 128)), conv((64, 64, 256, 256))):
        assert why("cuda_conv_rows", spec) is None, spec
    assert "W=64" in why("cuda_conv_rows", conv((1, 64, 64, 64)))
    assert "64->3" in why("cuda_conv_rows", conv((1, 64, 128, 128), 3))
    assert "plain stride-1" in why("cuda_conv_rows", conv((1, 64, 128, 128), stride=2))
    with pytest.warns(RuntimeWarning, match="CUDA row conv kernel is unavailable .*NVRTC could not compile"):
        cuda_conv_rows.give_up(RuntimeError("NVRTC could not compile conv_row_sm90.cu for sm_90a"))
    assert "NVRTC could not compile" in why("cuda_conv_rows", conv((1, 64, 256, 256)))


def test_cuda_conv_tiles_takes_64k_to_128k_channels(h200):
    from taesd_fast.kernels import cuda_conv_tiles

    for spec in (conv((1, 256, 40, 64), 256, residual=True), conv((1, 128, 88, 160), 128), conv((8, 64, 5, 3), 128),
                 conv((2, 192, 13, 24), 256)):
        assert why("cuda_conv_tiles", spec) is None, spec
    assert "64->64" in why("cuda_conv_tiles", conv((1, 64, 128, 128)))
    assert "96->128" in why("cuda_conv_tiles", conv((1, 96, 16, 16), 128))
    assert "plain stride-1" in why("cuda_conv_tiles", conv((1, 128, 16, 16), 128, stride=2))
    assert "plain stride-1" in why("cuda_conv_tiles", conv((1, 128, 16, 16), 128, upsample=2))
    assert why("cuda_conv_tiles", conv((1, 128, 16, 16), 128, device="cpu")) == "CPU tensor"
    with pytest.warns(RuntimeWarning, match="CUDA tile conv kernel is unavailable .*NVRTC could not compile"):
        cuda_conv_tiles.give_up(RuntimeError("NVRTC could not compile conv_tile_sm90.cu for sm_90a"))
    assert "NVRTC could not compile" in why("cuda_conv_tiles", conv((1, 256, 40, 64), 256))


@pytest.mark.parametrize("B,H,W,c_in,c_out,config", [
    (1, 40, 64, 256, 256, (1, 4, 64, 2)),  # taew2_1's step, 256 channels: 80 programs, two chunks a K step
    (1, 80, 128, 128, 128, (2, 4, 64, 1)),  # its 128-channel stage: 160 one-warpgroup programs, more than 132 SMs
    (1, 44, 80, 256, 256, (1, 4, 16, 2)),  # taew2_2's: 80 columns in five 16-column boxes of 4 rows
    (1, 88, 160, 128, 128, (2, 4, 32, 1)),
    (2, 9, 20, 192, 256, (1, 4, 8, 1)),  # three chunks: one a K step
    (3, 37, 50, 256, 128, (1, 4, 8, 2))])  # 50 columns: seven 8-column boxes pad least
def test_cuda_conv_tiles_config(B, H, W, c_in, c_out, config):
    from taesd_fast.kernels import cuda_conv_tiles

    cfg = cuda_conv_tiles.tile_config(B, H, W, c_in, c_out, 132)
    assert (cfg.wg, cfg.stages, cfg.bw, cfg.nc) == config
    assert cfg.smem <= 227 * 1024  # an H200 program's shared-memory limit
    assert cfg.defines == {"WG": config[0], "STAGES": 4, "BW": config[2], "NC": config[3]}


def test_cuda_conv_tiles_refuses_a_build_whose_chunks_do_not_divide_c_in():
    """A K step of two chunks needs C_in in multiples of 128: a build that does not fit the call is refused with a
    one-line error before anything touches the GPU (the rule never picks one)."""
    from taesd_fast.kernels import cuda_conv_tiles

    x = torch.zeros(1, 192, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiples of 128, got 192"):
        cuda_conv_tiles.launch(x, torch.zeros(9 * 128, 192, dtype=torch.float16), None, None,
                               torch.zeros(1, 128, 8, 8, dtype=torch.float16), False, False,
                               cuda_conv_tiles.TileConfig(1, 4, 8, 2))


def mem(x_shape, c_out=None, frames=2, memory=True, dtype=F16, layout="channels_last", device="cuda:0") -> Spec:
    c = x_shape[1]
    return Spec("mem_conv", device, tuple(x_shape), (c_out or c, 2 * c, 3, 3), dtype, 1, True, memory, True, layout,
                frames=frames)


def test_cuda_mem_conv_takes_64_channel_memory_blocks_wider_than_64(h200):
    from taesd_fast.kernels import cuda_conv_rows

    for spec in (mem((2, 64, 160, 256)), mem((8, 64, 176, 320), frames=8, memory=False), mem((6, 64, 33, 65), 64, 3)):
        assert why("cuda_mem_conv", spec) is None, spec
    assert "128 channels per half" in why("cuda_mem_conv", mem((2, 128, 80, 128)))
    assert "-> 32" in why("cuda_mem_conv", mem((2, 64, 80, 128), 32))
    assert "W=64" in why("cuda_mem_conv", mem((2, 64, 64, 64)))
    assert "samples of 2" in why("cuda_mem_conv", mem((3, 64, 80, 128)))
    assert "float16" in why("cuda_mem_conv", mem((2, 64, 80, 128), dtype=torch.float32))
    assert "nchw input" in why("cuda_mem_conv", mem((2, 64, 80, 128), layout="nchw"))
    assert why("cuda_mem_conv", mem((2, 64, 80, 128), device="cpu")) == "CPU tensor"
    with pytest.warns(RuntimeWarning, match="CUDA row conv kernel is unavailable"):
        cuda_conv_rows.give_up(RuntimeError("NVRTC could not compile conv_row_sm90.cu for sm_90a"))
    assert "NVRTC could not compile" in why("cuda_mem_conv", mem((2, 64, 160, 256)))


def test_cuda_mem_conv_launch_refuses_what_the_rule_refuses():
    from taesd_fast.kernels import cuda_mem_conv

    x = torch.randn(2, 64, 8, 64).half().contiguous(memory_format=torch.channels_last)
    w = torch.randn(64, 128, 3, 3).half()
    with pytest.raises(ValueError, match="cuda_mem_conv: W=64"):
        cuda_mem_conv.mem_conv_launch(x, None, w, None, 2, True)
    x = torch.randn(2, 64, 8, 72).half().contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"memory \(1, 64, 8, 64\) does not match x"):
        cuda_mem_conv.mem_conv_launch(x, torch.randn(1, 64, 8, 64).half(), w, None, 2, True)


@pytest.mark.parametrize("variant", ["tile", "ocb4", "rb"])
def test_simt_rows_take_nchw_f16_up_to_64_channels(variant):
    name = f"simt_f16_{variant}"
    r = table.row("conv2d", name)
    assert r.layouts == ("nchw",) and r.nvrtc
    for spec in (conv((1, 3, 16, 16), 64, layout="nchw"), conv((2, 64, 9, 7), 3, layout="nchw")):
        assert why(name, spec) is None, spec
    assert "1..64" in why(name, conv((1, 128, 8, 8), 64, layout="nchw"))
    assert "fold" in why(name, conv((1, 64, 8, 8), upsample=2, layout="nchw"))
    stride2 = why(name, conv((1, 64, 8, 8), stride=2, layout="nchw"))
    assert (stride2 is not None and "stride 1 only" in stride2) if variant == "rb" else stride2 is None


# --------------------------------------------------------------------------- launches refuse what rules refuse


@needs_gluon
@pytest.mark.parametrize("module,args,limit", [
    ("gluon_conv_rows", ((1, 32, 64, 64), 64, 1, 1), "32->64"),
    ("gluon_conv_tile", ((1, 64, 32, 32), 3, 1, 1), "64->3"),
    ("gluon_conv_up", ((1, 64, 16, 16), 64, 1, 1), "plain upsample fold"),
    ("gluon_conv_narrow", ((1, 64, 8, 300), 3, 1, 1), "W=300"),
    ("cuda_conv_rows", ((1, 64, 64, 64), 64, 1, 1), "W=64"),
    ("cuda_conv_tiles", ((1, 128, 16, 16), 64, 1, 1), "128->64 channels"),
])
def test_launch_refuses_what_the_rule_refuses(module, args, limit):
    import importlib

    m = importlib.import_module(f"taesd_fast.kernels.{module}")
    x_shape, c_out, stride, upsample = args
    x = torch.randn(x_shape).half().contiguous(memory_format=torch.channels_last)
    w = torch.randn(c_out, x_shape[1], 3, 3).half()
    with pytest.raises(ValueError, match=limit):
        m.launch_conv(x, w, None, None, stride, False, upsample)


# --------------------------------------------------------------------------- head rows' rules


def test_head_rows_rules(h200):
    wan = head_full((1, 256, 4, 44, 80))  # the Wan chunk's head, at 1/8 of 352x640
    for name in ("cuda_fused", "gluon_fused", "triton_fused", "triton_norm_split", "split_bf16"):
        assert why(name, wan) is None, name
        assert why(name, head_full((1, 256, 4, 44, 80), dtype=F16)) is not None, name  # bf16 only
        assert why(name, head_full((1, 256, 4, 44, 80), c_out=13)) is not None, name  # 9 * C_out <= 112
    # the Hopper g kernels keep the weights in shared memory: C a multiple of 64 up to 256
    assert "multiple of 64" in why("cuda_fused", head_full((1, 32, 4, 8, 8)))
    assert "multiple of 64" in why("gluon_fused", head_full((1, 32, 4, 8, 8)))
    assert why("triton_fused", head_full((1, 32, 4, 8, 8))) is None  # the Triton kernel: any power of two 16..256
    assert "power of two" in why("triton_fused", head_full((1, 96, 4, 8, 8)))
    # frames are unrolled in the Gluon kernel (T <= 16); the CUDA kernel takes T as an argument
    assert "T=17" in why("gluon_fused", head_full((1, 256, 17, 8, 8)))
    assert why("cuda_fused", head_full((1, 256, 17, 8, 8))) is None
    assert "multiple of 8" in why("cuda_fused", head_full((1, 256, 4, 9, 7)))  # TMA strides
    assert why("split_bf16", head_full((1, 256, 1, 8, 8))) is None  # one frame + 2 cached make the 3-frame window
    split_head = Spec("head", "cuda:0", (1, 256, 6, 8, 8), (12, 256, 3, 3, 3), BF16, 1, True, False, False, "nchw")
    assert why("split_bf16", split_head) is None
    assert "T+2 >= 3" in why("split_bf16", Spec("head", "cuda:0", (1, 256, 2, 8, 8), (12, 256, 3, 3, 3), BF16, 1,
                                                  True, False, False, "nchw"))
