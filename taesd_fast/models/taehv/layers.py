"""TAEHV building blocks and the encoder/decoder Sequentials, with upstream (madebyollin/taehv) state_dict keys.

Frames are processed as a batch of N*k images [N*k, C, H, W] (k frames per sample, time-major inside a sample).
The memory blocks see their own input at the previous frame; `sequence.run_sequence` walks a Sequential over them.

Fast-path structure (every conv goes through `taesd_fast.dispatch`):
- conv + bias (+ residual) (+ ReLU) are one dispatch call, so a kernel can fuse the epilogue;
- the decoder's soft clamp is folded into its first conv (`pre_clamp`);
- base decoder: nearest upsample -> TGrow -> conv runs as TGrow's 1x1 conv at low resolution (a 1x1 conv and a
  nearest upsample commute), then the 3x3 conv with the upsample folded in (`upsample=2`): 4x fewer pixels for the
  1x1 conv and no upsampled tensor when a kernel folds it. On CUDA with kernels, TGrow itself is folded into that
  conv's weights (`grow_conv`), so its output is never written;
- the decoder's last conv writes the output frames itself where a kernel does that (`narrow_frames`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import dispatch
from ...kernels.conv_pack import compose_grow
from ...kernels.derived import derived
from ..layers import Clamp, DispatchConv2d, conv1x1, conv3x3

BASE_WIDTHS = (256, 128, 64, 64)
SUPER_WIDTHS = (512, 256, 128, 64)
ENCODER_WIDTH = 64
IMAGE_CHANNELS = 3


@dataclass(frozen=True)
class TAEHVArch:
    """What the tensors of a TAEHV checkpoint fix: latent channels, pixel-(un)shuffle patch, decoder kind, and the
    time stride of each encoder TPool / decoder TGrow stage."""

    latent_channels: int
    patch_size: int
    super_decoder: bool = False
    encoder_time: tuple = (2, 2, 1)
    decoder_time: tuple = (1, 2, 2)

    @property
    def t_downscale(self) -> int:
        return math.prod(self.encoder_time)

    @property
    def t_upscale(self) -> int:
        return math.prod(self.decoder_time)

    @property
    def space_scale(self) -> int:
        """Pixels per latent cell along each side."""
        return 8 * self.patch_size

    def describe(self) -> str:
        return (f"{self.latent_channels} latent channels, patch {self.patch_size}, "
                f"{'super' if self.super_decoder else 'base'} decoder, time x{self.t_downscale} down / "
                f"x{self.t_upscale} up")


class MemBlock(nn.Module):
    """relu(conv-relu-conv-relu-conv(cat[x, past]) + skip(x)). Keys conv.{0,2,4}.{weight,bias}, skip.weight.

    The first conv is one `dispatch.mem_conv` call on x and the block's memory: a kernel row reads each frame's
    past where it lies (the frame before it, or the memory frame), so neither the past frames nor the
    concatenation are built. With one frame per sample and the memory's half of that conv computed ahead
    (`projected`, see `sequence.MemoryProjections`), it is a conv of x alone with `projected` as its residual."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv = nn.Sequential(conv3x3(2 * n_in, n_out), nn.ReLU(), conv3x3(n_out, n_out), nn.ReLU(),
                                  conv3x3(n_out, n_out))
        self.skip = conv1x1(n_in, n_out) if n_in != n_out else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, frames: int,
                projected: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B*frames, C, H, W], `frames` consecutive frames per sample; memory: [B, C, H, W], the block's input at
        the frame before each sample's first (None: zeros, the start of a video); projected (frames 1 only):
        conv(memory, the first conv's past half) + its bias."""
        first, _, second, _, third = self.conv
        if projected is None:
            h = dispatch.mem_conv(x, memory, first.weight, first.bias, frames=frames, relu=True, layer=first)
        else:
            h = dispatch.conv2d(x, self.first_half(past=False)[0], None, residual=projected, relu=True, layer=first)
        h = second(h, relu=True)
        return third(h, residual=self.skip(x), relu=True)

    def first_half(self, past: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the first conv's weight columns that read x, or with past=True those that read the past; its bias), as
        cached compact tensors (`weight_rows`)."""
        first, n_in = self.conv[0], self.conv[0].in_channels // 2
        return weight_rows(first, slice(None), slice(n_in, None) if past else slice(0, n_in))


class SuperMemBlock(nn.Module):
    """x + 1x1(4n->n)(relu(1x1(2n->4n)(dw7x7(cat[x, past])))). Keys conv.0.weight (depthwise), conv.1.{weight,bias},
    conv.3.weight."""

    def __init__(self, n: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * n, 2 * n, 7, padding=3, groups=2 * n, bias=False),
                                  DispatchConv2d(2 * n, 4 * n, 1), nn.ReLU(), conv1x1(4 * n, n))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        depthwise, expand, _, project = self.conv
        h = F.conv2d(torch.cat([x, past], 1), depthwise.weight, None, padding=3, groups=depthwise.groups)
        return project(expand(h, relu=True), residual=x)


class TPool(nn.Module):
    """Folds `stride` consecutive frames into channels, then a bias-free 1x1 conv. Key conv.weight.

    On CUDA with a channels_last input the fold is never made: the 1x1 conv is `stride` batched GEMMs (cuBLAS), one
    per frame of each run, over that frame's slice of the weight, accumulated into one output. At the encoder's
    first stage (64 channels at full resolution) the fold's copy moved more bytes than the conv itself."""

    def __init__(self, n: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = conv1x1(n * stride, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1 and x.is_cuda and _channels_last(x):
            return _pooled_frames(x, self.conv.weight, self.stride)
        return self.conv(frames_to_channels(x, self.stride))


def _pooled_frames(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """conv1x1(frames_to_channels(x, stride), weight) for a channels_last x [n*stride, C, H, W], as `stride` GEMMs
    reading the frames where they are: [n, H*W, C] @ weight[:, j*C:(j+1)*C].T summed over j (fp32 accumulation
    within each GEMM). Returns [n, C_out, H, W], channels_last."""
    nt, c, h, w = x.shape
    n = nt // stride
    frames = x.permute(0, 2, 3, 1).reshape(n, stride, h * w, c)  # a view: channels_last memory is [frame, H, W, C]
    slices = weight.reshape(weight.shape[0], stride, c)
    out = torch.bmm(frames[:, 0], slices[:, 0].t().expand(n, -1, -1))
    for j in range(1, stride):
        out.baddbmm_(frames[:, j], slices[:, j].t().expand(n, -1, -1))
    return out.view(n, h, w, -1).permute(0, 3, 1, 2)


class TGrow(nn.Module):
    """Bias-free 1x1 conv to stride*C channels, unfolded into `stride` consecutive frames. Key conv.weight.

    On CUDA with a channels_last input the conv's output is never unfolded: each output frame is one cuBLAS GEMM
    over its slice of the weight, written where that frame lies (TPool's path in reverse).

    With time upscaling switched off (`upscale=False`) only the last frame's rows of the weight are used."""

    def __init__(self, n: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = conv1x1(n, n * stride)

    def forward(self, x: torch.Tensor, upscale: bool = True) -> torch.Tensor:
        c = x.shape[1]
        if upscale and self.stride > 1 and x.is_cuda and _channels_last(x):
            return _grown_frames(x, self.conv.weight, self.stride)
        if upscale or self.stride == 1:
            return channels_to_frames(self.conv(x), self.stride)
        weight, _ = weight_rows(self.conv, slice(-c, None))
        return dispatch.conv2d(x, weight, None, layer=self.conv)


def grow_conv(grow: TGrow, conv: DispatchConv2d, x: torch.Tensor, upscale: bool, upsample: int,
              relu: bool) -> torch.Tensor:
    """conv(up(grow(x, upscale))), ReLU'd if relu: the base decoder's Upsample -> TGrow -> conv (`upsample` 2, or 1
    with space upscaling off). TGrow's 1x1 conv and the upsample are linear and TGrow has no bias, so output frame t
    of an input frame is the conv of up(x) with the composed weight conv.weight . g_t. On CUDA with f16 kernels in
    play, TGrow is folded into the conv that way, and its output (`frames` times the input) is never written:
    - one output frame per input frame (TGrow stride 1, or time upscaling off): the dispatcher's conv2d on x with
      the composed weight (`composed_weight`; the shapes of the conv on grow(x), so the same row);
    - several: where the dispatcher has decided triton_conv_tma or cuda_conv_up for the conv on grow(x), that
      kernel's grow launch runs it on x with one composed weight per frame (triton_conv_tma.grow_launch, BENCHMARKS.md,
      seventeenth session; cuda_conv_up.grow_launch). Inside a CUDA-graph capture, a fold that has not run before
      runs as PyTorch's TGrow and conv instead, and the graph is captured again at the next call.
    Elsewhere (CPU, backend "torch", torch.compile, autograd, other dtypes, a shape not decided yet): TGrow, then the
    conv, as upstream computes them."""
    frames = grow.stride if upscale else 1
    if not _foldable(x, grow, conv):
        return conv(grow(x, upscale), upsample=upsample, relu=relu)
    if frames == 1:
        return dispatch.conv2d(x, composed_weight(grow, conv), conv.bias, relu=relu, upsample=upsample, layer=conv)
    choice = dispatch.conv2d_choice(x, conv.weight, conv.bias, batch=x.shape[0] * frames, relu=relu,
                                    upsample=upsample)
    args = (x, grow.conv.weight, conv.weight, conv.bias, frames, relu)
    if choice == "triton_conv_tma":
        from ...kernels import triton_conv_tma as kernel  # loaded already: the dispatcher chose its row

        launch, ready = (lambda: kernel.grow_launch(*args, upsample)), (lambda: kernel.grow_ready(*args, upsample))
    elif choice == "cuda_conv_up":
        from ...kernels import cuda_conv_up as kernel  # loaded already: the dispatcher chose its row

        launch, ready = (lambda: kernel.grow_launch(*args)), (lambda: kernel.grow_ready(*args[:3], frames))
    else:
        return conv(grow(x, upscale), upsample=upsample, relu=relu)
    if torch.cuda.is_current_stream_capturing() and not ready():
        # The fold's first launch loads its build and packs its weight (from the host): neither may happen while a
        # CUDA graph captures. This capture runs PyTorch's TGrow and conv, and the next call captures again, its
        # warm-up running the fold first.
        dispatch.capture_again()
        with dispatch.backend("torch"):
            return conv(grow(x, upscale), upsample=upsample, relu=relu)
    return launch()


def narrow_frames(conv: DispatchConv2d, x: torch.Tensor, into: torch.Tensor, skip: int) -> bool:
    """The decoder's last conv and the output frames in one launch: where the dispatcher has decided cuda_conv_narrow
    for conv(x), its frames launch writes clamp(pixel_shuffle(conv(x))) (uint8 if `into` is) into `into`, without
    each sample's first `skip` frames, and this returns True; the conv's output is never stored. Elsewhere False,
    and the caller runs the conv and its frames pass. Inside a CUDA-graph capture, a launch that would first load
    the kernel or pack its weight returns False and the graph is captured again at the next call, as grow_conv."""
    if not _kernels_apply(x, conv.weight) or not into.is_cuda:
        return False
    if dispatch.conv2d_choice(x, conv.weight, conv.bias, batch=x.shape[0]) != "cuda_conv_narrow":
        return False
    from ...kernels import cuda_conv_narrow as kernel  # loaded already: the dispatcher chose its row

    if kernel.frames_reason(x, conv.weight, into, skip) is not None:
        return False
    if torch.cuda.is_current_stream_capturing() and not kernel.frames_ready(x, conv.weight):
        dispatch.capture_again()
        return False
    kernel.frames_launch(x, conv.weight, conv.bias, into, skip)
    return True


def _kernels_apply(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a fused form of ours may replace the layers' own calls: f16 channels_last CUDA input, kernels in play,
    outside torch.compile and autograd."""
    if not (x.is_cuda and x.dtype == torch.float16 and _channels_last(x)) or dispatch.get_backend() == "torch":
        return False
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))


def _foldable(x: torch.Tensor, grow: TGrow, conv: DispatchConv2d) -> bool:
    """Whether grow_conv may fold TGrow into the conv (tools/profile_taehv.py and tests switch it)."""
    return _kernels_apply(x, grow.conv.weight, conv.weight)


def composed_weight(grow: TGrow, conv: DispatchConv2d) -> torch.Tensor:
    """conv.weight composed with the last frame's rows of TGrow's 1x1 weight (all of it at stride 1): [C_out, C, 3,
    3], the weight of conv(grow(x)) for one output frame per input frame. Computed in fp32 (float64 weights: float64)
    and rounded to the conv weight's dtype once; kept in the derived-tensor cache with conv.weight until either
    weight changes (so kernels, which cache their packed weights per tensor, see the same tensor)."""
    g, w = grow.conv.weight, conv.weight
    c = g.shape[1]

    def build() -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: kernels cache what they derive from it
            return compose_grow(w, g[-c:])[0].to(w.dtype).contiguous()

    return derived.get(w, "grow composed", build, also=(g,))


def _grown_frames(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """channels_to_frames(conv1x1(x, weight), stride) for a channels_last x [n, C, H, W]: for each j < stride, frame
    j of every run is [n, H*W, C] @ weight[j*C_out:(j+1)*C_out].T, a batched GEMM written straight into that frame's
    rows of the output (batch stride stride*H*W*C_out, which cuBLAS takes as is: no copy). Returns
    [n*stride, C_out, H, W], channels_last."""
    n, c, h, w = x.shape
    c_out = weight.shape[0] // stride
    out = torch.empty((n * stride, c_out, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    rows = x.permute(0, 2, 3, 1).reshape(n, h * w, c)  # a view: channels_last memory is [frame, H, W, C]
    frames = out.permute(0, 2, 3, 1).view(n, stride, h * w, c_out)
    slices = weight.reshape(stride, c_out, c)
    for j in range(stride):
        torch.bmm(rows, slices[j].t().expand(n, -1, -1), out=frames[:, j])
    return out


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def frames_to_channels(x: torch.Tensor, stride: int) -> torch.Tensor:
    """[n*stride, C, H, W] -> [n, stride*C, H, W]: each run of `stride` consecutive frames stacked along channels
    (frame j of a run holds channels j*C..(j+1)*C-1), as upstream's reshape does. A channels_last input gives a
    channels_last output (one copy), so the conv after it reads its native layout; reshape would make it NCHW."""
    nt, c, h, w = x.shape
    if stride == 1:
        return x
    if not _channels_last(x):
        return x.reshape(nt // stride, stride * c, h, w)
    out = torch.empty((nt // stride, stride * c, h, w), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    # channels_last memory is [frame, H, W, C]: copy [n, j, H, W, C] to [n, H, W, j, C].
    out.permute(0, 2, 3, 1).view(nt // stride, h, w, stride, c).copy_(
        x.permute(0, 2, 3, 1).view(nt // stride, stride, h, w, c).permute(0, 2, 3, 1, 4))
    return out


def channels_to_frames(y: torch.Tensor, stride: int) -> torch.Tensor:
    """[n, stride*C, H, W] -> [n*stride, C, H, W], the inverse of `frames_to_channels` (TGrow's unfold into
    frames), keeping a channels_last input channels_last."""
    n, sc, h, w = y.shape
    c = sc // stride
    if stride == 1:
        return y
    if not _channels_last(y):
        return y.reshape(n * stride, c, h, w)
    out = torch.empty((n * stride, c, h, w), dtype=y.dtype, device=y.device, memory_format=torch.channels_last)
    out.permute(0, 2, 3, 1).view(n, stride, h, w, c).copy_(
        y.permute(0, 2, 3, 1).view(n, h, w, stride, c).permute(0, 3, 1, 2, 4))
    return out


def weight_rows(conv: nn.Conv2d, rows: slice, columns: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight[rows][:, columns], bias[rows]) as compact tensors in the weight's memory format, kept until the
    weight changes (one entry per slice pair): the kernels cache their packed weights per tensor object, so a fresh
    slice on every call would repack."""
    w = conv.weight
    part = (rows.start, rows.stop, rows.step, columns.start, columns.stop, columns.step)
    stamp = (w.data_ptr(), w._version, w.dtype, w.device, w.stride())
    cache = conv.__dict__.setdefault("_rows_cache", {})
    hit = cache.get(part)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    fmt = torch.channels_last if w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() \
        else torch.contiguous_format
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor: kernels cache what they derive from it
        value = (w[rows][:, columns].contiguous(memory_format=fmt),
                 None if conv.bias is None else conv.bias[rows].contiguous())
    cache[part] = (stamp, value)
    return value


def build_encoder(arch: TAEHVArch) -> nn.Sequential:
    """The encoder Sequential (indices are the upstream keys' first component)."""
    w = ENCODER_WIDTH
    layers: list[nn.Module] = [conv3x3(IMAGE_CHANNELS * arch.patch_size ** 2, w), nn.ReLU()]
    for stride in arch.encoder_time:
        layers += [TPool(w, stride), conv3x3(w, w, stride=2, bias=False)] + [MemBlock(w, w) for _ in range(3)]
    layers.append(conv3x3(w, arch.latent_channels))
    return nn.Sequential(*layers)


def build_decoder(arch: TAEHVArch) -> nn.Sequential:
    """The base or super decoder Sequential (indices are the upstream keys' first component)."""
    out = IMAGE_CHANNELS * arch.patch_size ** 2
    if arch.super_decoder:
        n = SUPER_WIDTHS
        layers: list[nn.Module] = [conv1x1(arch.latent_channels, n[0])]
        for stage in range(3):
            layers += [SuperMemBlock(n[stage]) for _ in range(3)]
            layers += [conv3x3(n[stage], 4 * n[stage + 1]), nn.ReLU(), nn.PixelShuffle(2),
                       TGrow(n[stage + 1], arch.decoder_time[stage])]
        layers.append(conv3x3(n[3], out))
        return nn.Sequential(*layers)
    n = BASE_WIDTHS
    layers = [Clamp(), conv3x3(arch.latent_channels, n[0]), nn.ReLU()]
    for stage in range(3):
        layers += [MemBlock(n[stage], n[stage]) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), TGrow(n[stage], arch.decoder_time[stage]),
                   conv3x3(n[stage], n[stage + 1], bias=False)]
    layers += [nn.ReLU(), conv3x3(n[3], out)]
    return nn.Sequential(*layers)
