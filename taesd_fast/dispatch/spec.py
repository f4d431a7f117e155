"""What a dispatch decision depends on: `Spec` (hashable, plain ints), its timings-file key, and the metadata of a
call's arguments (shapes, strides, dtypes, devices: never the tensors) from which candidates are timed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernel_env

TIMING_METHOD = 2  # in the timings-file key: 2 = graph-replay GPU time (+ eager launch CPU time); 1 = eager events


@dataclass(frozen=True)
class Spec:
    """Everything a decision depends on; hashable, shapes as plain ints."""

    kind: str  # "conv2d" | "mem_conv" | "head" | "head_full"
    device: str  # "cpu", "cuda:0", ...
    x_shape: tuple
    w_shape: tuple
    dtype: torch.dtype
    stride: int
    bias: bool
    residual: bool  # conv2d: a residual is added; head_full: a cache was given (the first chunk has none); mem_conv:
    # a memory frame was given (none at the start of a video)
    relu: bool
    layout: str  # "nchw" | "channels_last" | "strided"
    upsample: int = 1  # conv2d: nearest upsample of x by this factor before the conv (kernels fold it)
    pre_clamp: bool = False  # conv2d: soft clamp 3*tanh(x/3) of x before the conv (the decoder's Clamp)
    patch: int = 0  # head_full: unpatchify the output by this factor (0: none; kernels write the video directly)
    frames: int = 0  # mem_conv: consecutive frames per sample in x (each frame's past is the one before it)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def key(self, gpu: str, graph: bool = False) -> str:
        """Timings-file key; `graph` marks timings taken as CUDA-graph replays."""
        flags = "".join(f for f, on in (("b", self.bias), ("r", self.residual), ("R", self.relu)) if on) or "-"
        return (f"{gpu}|torch{torch.__version__}|src{kernel_env.sources_hash()}|t{TIMING_METHOD}|{self.kind}|"
                f"x{fmt_shape(self.x_shape)}|w{fmt_shape(self.w_shape)}|"
                f"{dtype_name(self.dtype)}|s{self.stride}|{flags}|{self.layout}"
                + (f"|u{self.upsample}" if self.upsample != 1 else "") + ("|clamp" if self.pre_clamp else "")
                + (f"|p{self.patch}" if self.patch else "") + (f"|f{self.frames}" if self.frames else "")
                + ("|graph" if graph else ""))


def fmt_shape(shape) -> str:
    return "x".join(map(str, shape))


def layout(x: Tensor) -> str:
    if x.is_contiguous():
        return "nchw"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last"
    return "strided"


def call_key(kind, x, w, b, stride, residual, relu, upsample=1, pre_clamp=False, patch=0, frames=0,
             x_shape=None) -> tuple:
    """Spec's fields as a plain tuple (same order), built on every call: the device and the shapes stay torch
    objects (hashing a torch.Size equals hashing the tuple); `spec_of` converts them on the slow path.
    x_shape: the input's shape in the key instead of x's (a lookup for a call of another batch)."""
    return (kind, x.device, x.shape if x_shape is None else x_shape, w.shape, x.dtype, stride, b is not None,
            residual is not None, relu, layout(x), upsample, pre_clamp, patch, frames)


def spec_of(key: tuple) -> Spec:
    kind, device, x_shape, w_shape, dtype, stride, bias, residual, relu, lay, upsample, pre_clamp, patch, frames = key
    return Spec(kind, str(device), tuple(x_shape), tuple(w_shape), dtype, int(stride), bool(bias), bool(residual),
                bool(relu), lay, int(upsample), bool(pre_clamp), int(patch), int(frames))


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument as metadata: enough to build a random stand-in with the same shape, strides, dtype and
    device, without keeping the caller's tensor alive."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def args_meta(args: tuple) -> tuple:
    """A call's arguments with each tensor replaced by its TensorMeta (numbers and None kept)."""
    return tuple(TensorMeta.of(a) if isinstance(a, Tensor) else a for a in args)


# ----------------------------------------------------------------------------- to and from the tuning process


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """"float16" for torch.float16: how timings keys, dispatch tables and the tuning process's messages spell it."""
    return str(dtype).replace("torch.", "")


def spec_to_json(spec: Spec) -> dict:
    """A Spec as plain JSON values (what the tuning process is sent)."""
    out = dict(spec.__dict__)
    out["dtype"] = dtype_name(spec.dtype)
    return out


def spec_from_json(data: dict) -> Spec:
    fields = dict(data)
    fields["dtype"] = _dtype(fields["dtype"])
    for name in ("x_shape", "w_shape"):
        fields[name] = tuple(fields[name])
    return Spec(**fields)


def meta_to_json(meta: tuple) -> list:
    """args_meta as JSON: a tensor as {"shape", "stride", "dtype", "device"}, numbers, booleans and None as they are."""
    return [{"shape": list(m.shape), "stride": list(m.stride), "dtype": dtype_name(m.dtype), "device": m.device}
            if isinstance(m, TensorMeta) else m for m in meta]


def meta_from_json(data: list) -> tuple:
    return tuple(TensorMeta(tuple(m["shape"]), tuple(m["stride"]), _dtype(m["dtype"]), m["device"])
                 if isinstance(m, dict) else m for m in data)
