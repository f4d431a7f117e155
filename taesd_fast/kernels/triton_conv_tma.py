"""The tensor-core conv's TMA kernel (row "triton_conv_tma", Hopper+): the same implicit GEMM as triton_conv's pointer
kernel, but each program owns a 2-D tile of TILE_H x TILE_W output pixels (one row of 64 or 128 where the width
allows: `row_config`) and loads every tap's input box [1, TILE_H, TILE_W, BLOCK_K] with one TMA copy from a 4-D NHWC
descriptor, and with `weight_tma` the weight slice by a second one. The TMA unit zero-fills the parts of a box
outside the image (negative or too large coordinates), so the conv's zero padding costs no masks and no per-pixel
address maths; the pointer kernel spends its issue slots on that arithmetic.

Covers stride 1 (with or without the upsample fold), C_in >= 16 and a multiple of the K chunk (tap mode), no
pre_clamp, up to 256 channels each way, sm_90+. The packed weight and the epilogue are the pointer kernel's
(conv_pack, conv_epilogue). x must start 16-byte aligned (TMA): a view that does not is copied first.

`grow_launch` runs the same kernel with TAEHV's TGrow folded in (GROW output frames per input frame, each with its
own composed weight), for models/taehv/layers.py `grow_conv`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .conv_contract import check_conv_args, conv_shape_reason, grow_weight_reason, new_out, output_shape
from .conv_epilogue import epilogue, tile_origin, upsample_phase
from .conv_launch import contiguous_bias, conv_row_run, launched, mark_launched, on_device, prepare, spec_launched
from .conv_pack import compose_grow, pack_weight, packed_weight, plan
from .device import capability, sm_count
from .derived import derived
from .tma_pdl import aligned_nhwc, pdl_args, pdl_start
from .triton_import import TRITON_ERROR, tl, triton, triton_unavailable_reason

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

NAME = "triton_conv_tma"


@dataclass(frozen=True)
class TMAConfig:
    """Launch config: 2-D tiles of (block_m // tile_w) x tile_w pixels; persistent > 0: that many programs per SM,
    each looping over tiles (the next tile's loads overlap this tile's epilogue); block_n: output channels per
    program (0: conv_pack.plan's, up to 128; a smaller power of two splits them over more programs)."""

    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 3
    tile_w: int = 16
    persistent: int = 0
    block_n: int = 0
    weight_tma: bool = False  # the weight slice by a TMA copy (else per-thread loads)

    def n_block(self, p) -> int:
        """The program's output channels for plan p (block_n must divide p.n_pad)."""
        return self.block_n or p.block_n


CPU_SMS = 132  # the SM count assumed for launches under the interpreter (an H200's), so they take the GPU's configs


def default_config(c_out: int, tiles: int = 0, sms: int = 0) -> TMAConfig:
    """128-pixel tiles of 8 x 16. With 128-wide channel blocks (C_out > 64) the pipeline is two stages deep: with
    three (or four) stages, Triton 3.6's build of this kernel wrote wrong values into a few output elements in some
    launches on the H200 (TAEHV's 128- and 256-channel convs; BENCHMARKS.md, "Correctness on the GPU").
    Where those programs (`tiles` of 8 x 16 pixels times the channel blocks) would not give every one of the `sms`
    SMs one, the channels go in 64-wide blocks, four stages deep: twice the programs. That is TAEHV's streaming
    step, one frame at 44x80 or 40x64 (BENCHMARKS.md, "Ninth session")."""
    bn = plan(64, c_out, 1).block_n
    if bn < 128:
        return TMAConfig(128, 4, 3, 16)
    if tiles and tiles * -(-c_out // bn) < sms:
        return TMAConfig(128, 4, 4, 16, block_n=64)
    return TMAConfig(128, 4, 2, 16)


def grid_tiles(x_shape, upsample: int = 1, tile_h: int = 8, tile_w: int = 16) -> int:
    """Tiles of tile_h x tile_w pixels over x's images (stride 1; per phase of the upsample fold)."""
    B, _, H, W = x_shape
    return B * -(-H // tile_h) * -(-W // tile_w) * (4 if upsample == 2 else 1)


@functools.lru_cache(maxsize=16)
def device_sms(device: torch.device) -> int:
    """The device's SM count (CPU_SMS under the interpreter)."""
    return sm_count(device) if device.type == "cuda" else CPU_SMS


def shape_config(c_out: int, x_shape, upsample: int, device: torch.device) -> TMAConfig:
    """The config a call of this shape launches with: row_config where it applies, else default_config on the
    call's grid."""
    base = default_config(c_out, grid_tiles(x_shape, upsample), device_sms(device))
    return row_config(c_out, x_shape[3], base) or base


def row_config(c_out: int, width: int, base: TMAConfig) -> TMAConfig | None:
    """One-row tiles with TMA weight loads, three stages, or None. The grid's width (stride 1: the input's; the
    upsample fold's low-res grid) must be a multiple of the tile: a [1, 1, W, K] input box is the MMA's [M, K]
    operand in shared memory as it lies, so wgmma reads it there, where Triton 3.6 moves a box of several rows
    through registers (ldmatrix) behind CTA barriers first. Taken for 64 output channels at widths that are
    multiples of 128 (128-pixel tiles), and for more channels on small grids only (`base` took 64-wide channel
    blocks: TAEHV's one-frame step), in 128-wide channel blocks, at multiples of 64. The H200 timings, where it
    wins and where it lost (narrower outputs, 64-pixel tiles at 64 channels): BENCHMARKS.md, sixteenth session."""
    if c_out == 64 and width % 128 == 0:
        return TMAConfig(128, 4, 3, 128, weight_tma=True)
    if c_out > 64 and base.block_n == 64 and width % 64 == 0:
        tile = 128 if width % 128 == 0 else 64
        return TMAConfig(tile, 4, 3, tile, block_n=128, weight_tma=True)
    return None


def unsupported_reason(c_in: int, stride: int, pre_clamp: bool, block_k: int, tile_w: int, block_m: int,
                       device: torch.device) -> str | None:
    """The kernel's own limits (beyond the conv contract), from the channel count, the config and the device."""
    if stride != 1:
        return "stride 2 (TMA boxes here are unit-stride)"
    if pre_clamp:
        return "pre_clamp (TMA copies go straight to shared memory; the clamp needs a pass through registers)"
    if c_in < 16 or c_in % block_k:
        return f"C_in={c_in} must be >= 16 and a multiple of block_k={block_k}"
    if tile_w < 8 or block_m % tile_w or tile_w & (tile_w - 1):
        return f"tile_w={tile_w} must be a power of two >= 8 dividing block_m={block_m}"
    if device.type == "cuda" and capability(device)[0] < 9:
        return "TMA needs compute capability 9.0 (Hopper) or newer"
    return None


if triton is not None:

    @triton.jit(do_not_specialize=["GH", "GW", "Ho", "Wo", "TILES_Y", "TILES_X", "NUM_TILES", "NUM_PROGS"])
    def _conv3x3_tc_tma_kernel(
        x_desc, w_desc, w_ptr, b_ptr, r_ptr, y_ptr,
        GH, GW, Ho, Wo, TILES_Y, TILES_X,  # GH x GW: the grid of output pixels (per phase for the upsample fold)
        NUM_TILES, NUM_PROGS,  # persistent launches loop over tiles pid, pid + NUM_PROGS, ...
        C_OUT: tl.constexpr, N_PAD: tl.constexpr, K_ROWS: tl.constexpr, CHUNKS: tl.constexpr, KS: tl.constexpr,
        UPSAMPLE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr,
        TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PERSISTENT: tl.constexpr, PDL: tl.constexpr, WEIGHT_TMA: tl.constexpr, GROW: tl.constexpr = 1,
    ):
        pdl_start(PDL)
        # PERSISTENT flattens the tile and K loops into one software pipeline, so the next tile's loads are in
        # flight during this tile's epilogue (K is only 9 steps: fill and drain are a large part of each tile).
        for pid in tl.range(tl.program_id(0), NUM_TILES, NUM_PROGS, flatten=PERSISTENT):
            _tma_tile(x_desc, w_desc, w_ptr, b_ptr, r_ptr, y_ptr, pid, GH, GW, Ho, Wo, TILES_Y, TILES_X, C_OUT, N_PAD,
                      K_ROWS, CHUNKS, KS, UPSAMPLE, HAS_BIAS, HAS_RES, RELU, TILE_H, TILE_W, BLOCK_N, BLOCK_K,
                      WEIGHT_TMA, GROW)

    @triton.jit
    def _tma_tile(
        x_desc, w_desc, w_ptr, b_ptr, r_ptr, y_ptr, pid, GH, GW, Ho, Wo, TILES_Y, TILES_X,
        C_OUT: tl.constexpr, N_PAD: tl.constexpr, K_ROWS: tl.constexpr, CHUNKS: tl.constexpr, KS: tl.constexpr,
        UPSAMPLE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr,
        TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WEIGHT_TMA: tl.constexpr, GROW: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = TILE_H * TILE_W
        phase, t, py, px = upsample_phase(pid, UPSAMPLE)
        img, gy0, gx0, rn = tile_origin(t, TILES_Y, TILES_X, TILE_H, TILE_W, C_OUT, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if GROW > 1:  # output frame img = (input frame, weight group): group g's packed phases follow group g-1's
            src = img // GROW
            w_row0 = ((img % GROW) * (4 if UPSAMPLE else 1) + phase) * K_ROWS
        else:
            src = img
            w_row0 = phase * K_ROWS
        w_base = w_ptr + w_row0 * N_PAD
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(KS * KS * CHUNKS):
            tap = kk // CHUNKS
            c0 = (kk % CHUNKS) * BLOCK_K
            # Box origin may be -1 or run past the image: TMA fills those pixels with zeros (the conv's padding).
            a = x_desc.load([src, gy0 + py - 1 + tap // KS, gx0 + px - 1 + tap % KS, c0])
            if WEIGHT_TMA:  # one TMA copy of the [BLOCK_K, BLOCK_N] slice instead of per-thread loads
                n0 = tl.program_id(1) * BLOCK_N if C_OUT > BLOCK_N else 0
                wt = w_desc.load([w_row0 + kk * BLOCK_K, n0])
            else:
                wt = tl.load(w_base + (kk * BLOCK_K + rk)[:, None] * N_PAD + rn[None, :])
            acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), wt, acc)

        rm = tl.arange(0, BLOCK_M)
        gy = gy0 + rm // TILE_W
        gx = gx0 + rm % TILE_W
        m_ok = (gy < GH) & (gx < GW)
        if UPSAMPLE:
            oy = 2 * gy + py
            ox = 2 * gx + px
        else:
            oy = gy
            ox = gx
        epilogue(acc, b_ptr, r_ptr, y_ptr, (img * Ho + oy) * Wo + ox, m_ok, rn, C_OUT, BLOCK_N, HAS_BIAS, HAS_RES,
                  RELU)


def _launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, p, cfg: TMAConfig,
            upsample: int, relu: bool, grow: int, not_pdl: list) -> None:
    """Launch the kernel on checked operands: x dense NHWC and 16-byte aligned, wp packed for plan p (`grow` weight
    groups), out [B * grow, C_out, Ho, Wo] channels_last; not_pdl: what this call packed or copied (then no PDL)."""
    B, _, H, W = x.shape
    c_out, Ho, Wo = out.shape[1:]
    GH, GW = (H, W) if upsample == 2 else (Ho, Wo)
    tile_h, tile_w = cfg.block_m // cfg.tile_w, cfg.tile_w
    tiles_y, tiles_x = -(-GH // tile_h), -(-GW // tile_w)
    tiles = B * grow * tiles_y * tiles_x * p.phases
    programs = tiles
    if cfg.persistent:  # under the interpreter: a few programs, so each loops over several tiles
        programs = min(tiles, cfg.persistent * sm_count(x.device) if x.is_cuda else 3)
    with on_device(x):
        x_desc = TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1), [1, tile_h, tile_w, p.block_k])
        block_n = cfg.n_block(p)
        w_desc = TensorDescriptor.from_tensor(wp.view(-1, p.n_pad), [p.block_k, block_n]) if cfg.weight_tma \
            else x_desc
        _conv3x3_tc_tma_kernel[(programs, p.n_pad // block_n)](
            x_desc, w_desc, wp, b if b is not None else wp, residual if residual is not None else out, out,
            GH, GW, Ho, Wo, tiles_y, tiles_x, tiles, programs,
            C_OUT=c_out, N_PAD=p.n_pad, K_ROWS=p.k_rows, CHUNKS=p.cin_pad // p.block_k, KS=p.ks,
            UPSAMPLE=upsample == 2, HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu),
            TILE_H=tile_h, TILE_W=tile_w, BLOCK_N=block_n, BLOCK_K=p.block_k, PERSISTENT=bool(cfg.persistent),
            WEIGHT_TMA=cfg.weight_tma, GROW=grow, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_args(x, not_pdl),
        )


def _config_and_plan(op: str, shape, c_out: int, stride: int, upsample: int, pre_clamp: bool, device,
                     config: TMAConfig | None):
    """(the launch's config: `config` or shape_config's for an input of `shape`; the weight's plan), or ValueError
    naming `op` where the kernel's limits (unsupported_reason) exclude them."""
    cfg = config or shape_config(c_out, shape, upsample, device)
    p = plan(shape[1], c_out, upsample)
    reason = unsupported_reason(shape[1], stride, pre_clamp, p.block_k, cfg.tile_w, cfg.block_m, device)
    if reason is not None:
        raise ValueError(f"{op}: {reason}")
    return cfg, p


def conv3x3_tma_launch(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                       upsample: int = 1, pre_clamp: bool = False, config: TMAConfig | None = None) -> Tensor:
    """Run the TMA kernel (benchmarks pass explicit configs). Returns channels_last y. Raises ValueError where the
    kernel's limits (unsupported_reason) exclude the call."""
    if triton is None:
        raise RuntimeError(f"conv3x3_tc_tma: {TRITON_ERROR}")
    call = prepare("conv3x3_tc_tma", x, w, b, residual, stride, upsample, tma=True)
    x, out, b, residual = call.x, call.out, call.b, call.residual
    cfg, p = _config_and_plan("conv3x3_tc_tma", x.shape, w.shape[0], stride, upsample, pre_clamp, x.device, config)
    wp, packed_now = packed_weight(w, upsample, p)
    _launch(x, wp, b, residual, out, p, cfg, upsample, relu, 1, packed_now + call.copied)
    mark_launched(NAME, x, w, stride, upsample, pre_clamp, b is not None, residual is not None, relu,
                  (cfg, tuple(x.shape)))
    return out


def grown_weight(grow_w: Tensor, w: Tensor, grow: int, upsample: int, p) -> tuple[Tensor, list]:
    """(packed weight, packed_now) for `grow_launch`: the `grow` composed weights w . g_t, each packed as
    conv_pack.pack_weight packs one weight, one after the other ([grow * phases, k_rows, n_pad]). Composed in fp32
    (with the upsample fold's sums) and rounded to f16 once; cached with w until w or grow_w changes."""
    packed_now: list = []

    def build() -> Tensor:
        packed_now.append("grown weight")
        composed = compose_grow(w, grow_w)
        return torch.cat([pack_weight(composed[t], upsample, p) for t in range(grow)])

    return derived.get(w, ("grow", grow, upsample, p), build, also=(grow_w,)), packed_now


def grow_launch(x: Tensor, grow_w: Tensor, w: Tensor, b: Tensor | None, grow: int, relu: bool, upsample: int = 1,
                config: TMAConfig | None = None) -> Tensor:
    """conv2d(up(g(x)), w, b) (ReLU'd if relu), where g is TAEHV's TGrow: a bias-free 1x1 conv x [B, C, H, W] ->
    [B, grow*C, H, W] (weight grow_w [grow*C, C, 1, 1]) whose channel group t becomes frame t of each input frame's
    `grow` frames. g and the upsample are linear and g has no bias, so output frame (i, t) is the conv of up(x[i])
    with the composed weight w . g_t: the kernel reads each input frame once per group and g's output (grow times
    the input) is never written. Returns [B*grow, C_out, Ho, Wo] channels_last, in the frame order TGrow gives.
    The config is the one the conv after TGrow would launch with (`shape_config` on the grown shape)."""
    if triton is None:
        raise RuntimeError(f"conv3x3_grow: {TRITON_ERROR}")
    check_conv_args("conv3x3_grow", x, w, b, None, 1, upsample)
    B, c, H, W = x.shape
    reason = grow_weight_reason(x, grow_w, grow)
    if reason is not None:
        raise ValueError(f"conv3x3_grow: {reason}")
    x = aligned_nhwc(x)
    b, copied = contiguous_bias(b)
    c_out = w.shape[0]
    grown = (B * grow, c, H, W)
    out = new_out(output_shape(grown, w.shape, 1, upsample), x)
    cfg, p = _config_and_plan("conv3x3_grow", grown, c_out, 1, upsample, False, x.device, config)
    wp, packed_now = grown_weight(grow_w, w, grow, upsample, p)
    _launch(x, wp, b, None, out, p, cfg, upsample, relu, grow, packed_now + copied)
    mark_launched(NAME, x, w, 1, upsample, False, b is not None, False, relu, ("grow", grow, cfg, grown))
    return out


def grow_ready(x: Tensor, grow_w: Tensor, w: Tensor, b: Tensor | None, grow: int, relu: bool,
               upsample: int = 1) -> bool:
    """Whether grow_launch on these operands would neither compile nor load a build (Triton does both at a build's
    first launch) nor pack its weight (packing copies from the host), so that it may run inside a CUDA-graph capture."""
    B, c, H, W = x.shape
    grown = (B * grow, c, H, W)
    cfg = shape_config(w.shape[0], grown, upsample, x.device)
    return (launched(NAME, x, w, 1, upsample, False, b is not None, False, relu, ("grow", grow, cfg, grown))
            and derived.has(w, ("grow", grow, upsample, plan(c, w.shape[0], upsample)), also=(grow_w,)))


def grow_variants(x: Tensor, w: Tensor, b: Tensor | None, stride: int, residual: Tensor | None, relu: bool,
                  upsample: int = 1, pre_clamp: bool = False) -> None:
    """The row's Row.variants: for a conv2d call that models/taehv/layers.grow_conv can fold (x: TGrow's output of
    two frames per input frame; no residual), `grow_launch` as the fold runs it, on x's first half of frames with a
    stand-in TGrow weight kept with w (so a second call reuses its packing, as the fold's later calls do). The
    tuning process records these launches with the row's (dispatch/compile_pool.record), so the fold's first launch
    in the user's process loads its kernel instead of compiling it."""
    if stride != 1 or residual is not None or pre_clamp or x.shape[0] % 2:
        return
    c = x.shape[1]
    gw = derived.get(w, "grow stand-in", lambda: torch.randn(2 * c, c, 1, 1, device=x.device, dtype=x.dtype))
    grow_launch(x[: x.shape[0] // 2], gw, w, b, 2, relu, upsample)


# --------------------------------------------------------------------------- the row


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA, Triton, the conv contract, then the kernel's limits with the default config."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    upsample = spec.upsample
    reason = triton_unavailable_reason(spec.device) or conv_shape_reason(
        spec.x_shape, spec.w_shape, spec.dtype, spec.stride, upsample)
    if reason is not None:
        return reason
    c_out, c_in = spec.w_shape[:2]
    cfg = default_config(c_out)
    return unsupported_reason(c_in, spec.stride, spec.pre_clamp, plan(c_in, c_out, upsample).block_k,
                              cfg.tile_w, cfg.block_m, torch.device(spec.device))


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (TMA launches specialise on the sizes)."""
    cfg = shape_config(spec.w_shape[0], spec.x_shape, spec.upsample, torch.device(spec.device))
    return spec_launched(NAME, spec, (cfg, tuple(spec.x_shape)))


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    return conv3x3_tma_launch(x, w, b, residual, stride, relu, upsample, pre_clamp)


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
