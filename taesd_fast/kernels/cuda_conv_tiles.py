"""The tiled implicit-GEMM conv in CUDA C++ (row "cuda_conv_tiles"; csrc/conv_tile_sm90.cu, compiled with NVRTC for
sm_90a) for 3x3 convs with 64k input and 128k output channels: a program computes 64 or 128 output pixels by 128
output channels with m64n128k16 wgmmas fed by TMA, a producer warp issuing the loads. It is built for the small
grids of a one-frame step (TAEHV's 256- and 128-channel stages at latent resolution), where the Triton kernels
spend several instructions per MMA.

Covers C_in % 64 == 0 and C_out % 128 == 0 (within the conv contract's 256), stride 1, no upsample or pre_clamp,
with or without bias and residual, sm_90 with NVRTC. x and the residual must start 16-byte aligned (TMA): views that
do not are copied first. A compile or launch failure is remembered: a warning once, the call raises, and from then
on the row's rule names the failure (so the dispatcher skips it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .. import _backend
from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason
from .conv_pack import packed_weight
from .device import sm_count
from .tma import nhwc_map, tensor_map

NAME = "cuda_conv_tiles"
SOURCE, KERNEL = "conv_tile_sm90.cu", "conv_tile_sm90"
BN = 128  # output channels per program

_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


@dataclass(frozen=True)
class TileConfig:
    """wg: consumer warpgroups per program (64 output pixels each); stages: K steps in flight; bw: columns of a
    warpgroup's box of 64 pixels (64 / bw rows); nc: channel chunks of 64 per K step."""

    wg: int
    stages: int
    bw: int
    nc: int = 1

    @property
    def defines(self) -> dict[str, int]:
        return {"WG": self.wg, "STAGES": self.stages, "BW": self.bw, "NC": self.nc}

    @property
    def smem(self) -> int:
        """The kernel's SMEM_BYTES plus 1024-byte alignment slack."""
        stage = self.nc * (self.wg * 8192 + BN * 128)
        return self.stages * stage + self.wg * (BN // 64) * 8192 + 8 * (2 * self.stages + 1) + 1024


def box_width(W: int) -> int:
    """Columns of a 64-pixel box: the width that pads the row least (64, 32, 16 or 8; the wider on a tie)."""
    return min((64, 32, 16, 8), key=lambda bw: (-(-W // bw) * bw, -bw))


def tile_config(B: int, H: int, W: int, c_in: int, c_out: int, sms: int) -> TileConfig:
    """One warpgroup per program while the programs fit in one wave, else two (one wave of programs, each loading
    its weight slices once for 128 pixels). Four stages. One warpgroup takes two channel chunks per K step where
    C_in allows: its loads are then half as many TMA instructions, and each costs the producer about as much
    whatever its size (at 8 to 16 KB). Two warpgroups keep one chunk: with two, only three stages fit, which was
    slower."""
    bw = box_width(W)
    programs = B * -(-H // (64 // bw)) * -(-W // bw) * (c_out // BN)
    wg = 1 if programs <= sms else 2
    return TileConfig(wg, 4, bw, 2 if wg == 1 and c_in % 128 == 0 else 1)


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: one warning; the row's rule names the failure from then on."""
    _backend.give_up(_failure, "CUDA tile conv kernel", error)


def shape_reason(c_in: int, c_out: int, stride: int, upsample: int, pre_clamp: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if c_in % 64 or c_out % BN:
        return f"{c_in}->{c_out} channels (the CUDA tile kernel does multiples of 64 -> multiples of {BN})"
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the CUDA tile kernel does plain stride-1 convs)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90, the conv contract, shape_reason, and no earlier compile failure (NVRTC
    itself is checked by the dispatcher for rows marked nvrtc)."""
    return (sm90_spec_reason(spec, _failure[0] if _failure else None)
            or shape_reason(spec.w_shape[1], spec.w_shape[0], spec.stride, spec.upsample, spec.pre_clamp))


def _config(x_shape, c_out: int, device) -> TileConfig:
    B, c_in, H, W = x_shape
    return tile_config(B, H, W, c_in, c_out, sm_count(device))


def spec_ready(spec) -> bool:
    """True once this shape's build (its TileConfig) is loaded on this device."""
    cfg = _config(spec.x_shape, spec.w_shape[0], spec.device)
    return _backend.is_loaded(SOURCE, KERNEL, cfg.defines, device=spec.device)


def launch(x: Tensor, wk: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool, pdl: bool,
           cfg: TileConfig) -> None:
    """x [B, C_in, H, W], residual and out [B, C_out, H, W]: channels_last f16, 16-byte aligned; wk: the weight as
    [9 * C_out, C_in] (row tap * C_out + c_out, K-major)."""
    B, c_in, H, W = x.shape
    c_out = out.shape[1]
    if c_in % (64 * cfg.nc):
        raise ValueError(f"cuda_conv_tiles build {cfg} takes C_in in multiples of {64 * cfg.nc}, got {c_in}")
    # A K step's nc channel chunks in one box each, the chunk dimension outside the rows (strides need not grow
    # with the dimension): weights (64 c_in, 9 * c_out rows, chunk), input (64 c, W, H, chunk, B).
    w_map = tensor_map(wk, [64, 9 * c_out, c_in // 64], [c_in, 64], [64, BN, cfg.nc])
    box = [64, cfg.bw, 64 // cfg.bw, 1]  # 128-byte swizzled: 64 channels x bw columns x 64 / bw rows
    x_map = tensor_map(x, [64, W, H, c_in // 64, B], [c_in, W * c_in, 64, H * W * c_in], box[:3] + [cfg.nc, 1])
    y_map = nhwc_map(out, box)
    r_map = nhwc_map(residual, box) if residual is not None else y_map
    tiles_w, tiles_h = -(-W // cfg.bw), -(-H // (cfg.wg * 64 // cfg.bw))
    m_tiles = B * tiles_h * tiles_w
    kernel = _backend.get_kernel(SOURCE, KERNEL, cfg.defines, device=x.device)
    kernel((m_tiles * (c_out // BN),), (128 * cfg.wg + 32,),
           [x_map, w_map, r_map, y_map, b, c_in, c_out, tiles_w, tiles_h, m_tiles,
            int(residual is not None), int(relu), int(pdl)], smem=cfg.smem, pdl=pdl)


def tap_major(w: Tensor) -> Tensor:
    """[C_out, C_in, 3, 3] -> f16 [9 * C_out, C_in], row tap * C_out + c_out (the kernel's K-major weight slices)."""
    c_out, c_in = w.shape[:2]
    return w.detach().permute(2, 3, 0, 1).reshape(9 * c_out, c_in).half().contiguous()


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False, cfg: TileConfig | None = None) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y.
    cfg: the build to launch (default: tile_config's)."""
    refuse = shape_reason(x.shape[1], w.shape[0], stride, upsample, pre_clamp)

    def kernel(call, wk, pdl):
        try:
            launch(call.x, wk, call.b, call.residual, call.out, relu, pdl["PDL"],
                   cfg or _config(call.x.shape, w.shape[0], call.x.device))
        except RuntimeError as e:  # NVRTC or the driver refused it; nothing was launched
            give_up(e)
            raise

    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, 1, None, tag=NAME, build=lambda: tap_major(w)), kernel)


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
