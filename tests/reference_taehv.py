"""An independent, deliberately plain float64 evaluation of the published TAEHV architectures.

Written from the published description (madebyollin/taehv's README and module description as summarised in the
video issue), not from taesd_fast: nothing here imports the package. It works frame by frame on Python lists of
[N, C, H, W] tensors, so it shares no time-batching logic with the package either.

  conv        3x3, padding 1 (stride 2 where the layout says so)        Clamp    tanh(x / 3) * 3
  MemBlock    relu(conv(relu(conv(relu(conv(cat[x, past]))))) + skip(x)), past = the block's input one frame earlier
              (zeros at the first frame); skip is a bias-free 1x1 conv when the widths differ
  SuperMemBlock  x + 1x1(relu(1x1(dw7x7(cat[x, past]))))
  TPool(s)    s consecutive frames stacked on channels (frame-major), bias-free 1x1 conv
  TGrow(s)    bias-free 1x1 conv to s*C channels, channel block j becomes frame j
Encoder: conv(3p²->64), relu, 3 x [TPool, conv stride 2 (no bias), 3 MemBlocks], conv(64->C).
Base decoder (widths 256, 128, 64, 64): Clamp, conv, relu, 3 x [3 MemBlocks, nearest upsample x2, TGrow, conv (no
  bias)], relu, conv(64->3p²); pixel shuffle p; clamp to [0, 1].
Super decoder (widths 512, 256, 128, 64): 1x1 conv (no bias), 3 x [3 SuperMemBlocks, conv(n->4n'), relu, pixel
  shuffle 2, TGrow], conv(64->3p²).
encode pads the end with the last frame to a multiple of the time downscale; decode drops the first t_up - 1 frames.
Preview knobs: time off uses a TGrow's last C rows; space off skips the base upsample, and in the super decoder keeps
the conv rows of the top-left sub-pixel (rows 4c) with no shuffle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BASE = (256, 128, 64, 64)
SUPER = (512, 256, 128, 64)


# ------------------------------------------------------------------------------------ the published key layout


def _conv(keys: dict, name: str, n_in: int, n_out: int, k: int = 3, bias: bool = True, groups: int = 1) -> None:
    keys[f"{name}.weight"] = (n_out, n_in // groups, k, k)
    if bias:
        keys[f"{name}.bias"] = (n_out,)


def _memblock(keys: dict, name: str, n: int) -> None:
    _conv(keys, f"{name}.conv.0", 2 * n, n)
    _conv(keys, f"{name}.conv.2", n, n)
    _conv(keys, f"{name}.conv.4", n, n)


def _super_memblock(keys: dict, name: str, n: int) -> None:
    _conv(keys, f"{name}.conv.0", 2 * n, 2 * n, k=7, bias=False, groups=2 * n)
    _conv(keys, f"{name}.conv.1", 2 * n, 4 * n, k=1)
    _conv(keys, f"{name}.conv.3", 4 * n, n, k=1, bias=False)


def published_keys(latent: int, patch: int, *, super_decoder: bool = False, encoder_time=(2, 2, 1),
                   decoder_time=(1, 2, 2), encoder: bool = True, decoder: bool = True) -> dict[str, tuple]:
    """Key -> shape of a published TAEHV file (`encoder.<i>...`, `decoder.<i>...`), from the description."""
    keys: dict[str, tuple] = {}
    image = 3 * patch * patch
    if encoder:
        _conv(keys, "encoder.0", image, 64)
        i = 2
        for stride in encoder_time:
            keys[f"encoder.{i}.conv.weight"] = (64, 64 * stride, 1, 1)
            _conv(keys, f"encoder.{i + 1}", 64, 64, bias=False)
            for j in range(3):
                _memblock(keys, f"encoder.{i + 2 + j}", 64)
            i += 5
        _conv(keys, f"encoder.{i}", 64, latent)
    if decoder and not super_decoder:
        _conv(keys, "decoder.1", latent, BASE[0])
        i = 3
        for stage, stride in enumerate(decoder_time):
            for j in range(3):
                _memblock(keys, f"decoder.{i + j}", BASE[stage])
            keys[f"decoder.{i + 4}.conv.weight"] = (BASE[stage] * stride, BASE[stage], 1, 1)
            _conv(keys, f"decoder.{i + 5}", BASE[stage], BASE[stage + 1], bias=False)
            i += 6
        _conv(keys, f"decoder.{i + 1}", 64, image)
    elif decoder:
        _conv(keys, "decoder.0", latent, SUPER[0], k=1, bias=False)
        i = 1
        for stage, stride in enumerate(decoder_time):
            for j in range(3):
                _super_memblock(keys, f"decoder.{i + j}", SUPER[stage])
            _conv(keys, f"decoder.{i + 3}", SUPER[stage], 4 * SUPER[stage + 1])
            keys[f"decoder.{i + 6}.conv.weight"] = (SUPER[stage + 1] * stride, SUPER[stage + 1], 1, 1)
            i += 7
        _conv(keys, f"decoder.{i}", 64, image)
    return keys


def random_state_dict(keys: dict[str, tuple], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors for `keys`, scaled so activations neither vanish nor explode through the network
    and the decoded pixels mostly stay inside [0, 1] (so the final clamp does not hide errors)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    last_decoder = max((k for k in keys if k.startswith("decoder.") and k.endswith(".weight")),
                       key=lambda k: int(k.split(".")[1]), default=None)
    for key, shape in keys.items():
        if key.endswith(".bias"):
            value = 0.05 * torch.randn(shape, generator=gen)
            if key == (last_decoder or "").replace(".weight", ".bias"):
                value += 0.5  # pixels around mid-grey
        else:
            fan_in = math.prod(shape[1:])
            gain = 0.3 if key == last_decoder else 1.0
            value = torch.randn(shape, generator=gen) * gain / math.sqrt(fan_in)
        state[key] = value
    return state


# ------------------------------------------------------------------------------------ evaluation


def _pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """out[n, c, h*r + i, w*r + j] = x[n, c*r*r + i*r + j, h, w], written with index loops."""
    n, crr, h, w = x.shape
    c = crr // (r * r)
    out = x.new_zeros(n, c, h * r, w * r)
    for i in range(r):
        for j in range(r):
            out[:, :, i::r, j::r] = x[:, [ch * r * r + i * r + j for ch in range(c)]]
    return out


def _depthwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise k x k conv with zero padding k // 2, as a sum of k² shifted, per-channel-weighted copies (float64
    grouped convs take a very slow path on the CPU)."""
    k = w.shape[-1]
    h, wd = x.shape[-2:]
    padded = F.pad(x, (k // 2,) * 4)
    out = torch.zeros_like(x)
    for i in range(k):
        for j in range(k):
            out += w[:, 0, i, j].view(1, -1, 1, 1) * padded[:, :, i:i + h, j:j + wd]
    return out


def _pixel_unshuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    n, c, hr, wr = x.shape
    out = x.new_zeros(n, c * r * r, hr // r, wr // r)
    for ch in range(c):
        for i in range(r):
            for j in range(r):
                out[:, ch * r * r + i * r + j] = x[:, ch, i::r, j::r]
    return out


class ReferenceTAEHV:
    """Float64 evaluation of a published-layout state dict (all keys must be used)."""

    def __init__(self, state: dict[str, torch.Tensor], *, time_upscale=(True, True, True),
                 space_upscale=(True, True, True)):
        self.p = {k: v.detach().to("cpu", torch.float64) for k, v in state.items()}
        self.used: set[str] = set()
        self.time_upscale, self.space_upscale = tuple(time_upscale), tuple(space_upscale)
        self.super = "decoder.0.weight" in self.p

    def _w(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.p[name]

    def _b(self, name: str):
        if name in self.p:
            self.used.add(name)
            return self.p[name]
        return None

    def _conv(self, name: str, x: torch.Tensor, stride: int = 1) -> torch.Tensor:
        w = self._w(f"{name}.weight")
        return F.conv2d(x, w, self._b(f"{name}.bias"), stride=stride, padding=w.shape[-1] // 2)

    def _mem(self, name: str, frames: list) -> list:
        out, past = [], torch.zeros_like(frames[0])
        for x in frames:
            h = torch.relu(self._conv(f"{name}.conv.0", torch.cat([x, past], 1)))
            h = torch.relu(self._conv(f"{name}.conv.2", h))
            h = self._conv(f"{name}.conv.4", h)
            skip = F.conv2d(x, self._w(f"{name}.skip.weight")) if f"{name}.skip.weight" in self.p else x
            out.append(torch.relu(h + skip))
            past = x
        return out

    def _super_mem(self, name: str, frames: list) -> list:
        out, past = [], torch.zeros_like(frames[0])
        for x in frames:
            xp = torch.cat([x, past], 1)
            h = _depthwise(xp, self._w(f"{name}.conv.0.weight"))
            h = torch.relu(self._conv(f"{name}.conv.1", h))
            out.append(x + self._conv(f"{name}.conv.3", h))
            past = x
        return out

    def _tpool(self, name: str, frames: list) -> list:
        w = self._w(f"{name}.conv.weight")
        s = w.shape[1] // w.shape[0]
        assert len(frames) % s == 0
        return [F.conv2d(torch.cat(frames[i:i + s], 1), w) for i in range(0, len(frames), s)]

    def _tgrow(self, name: str, frames: list, on: bool) -> list:
        w = self._w(f"{name}.conv.weight")
        c = w.shape[1]
        s = w.shape[0] // c
        if not on:
            return [F.conv2d(x, w[-c:]) for x in frames]
        out = []
        for x in frames:
            y = F.conv2d(x, w)
            out += [y[:, j * c:(j + 1) * c] for j in range(s)]
        return out

    @property
    def t_downscale(self) -> int:
        return math.prod(self.p[f"encoder.{i}.conv.weight"].shape[1] // 64 for i in (2, 7, 12))

    @property
    def t_upscale(self) -> int:
        idx = (7, 14, 21) if self.super else (7, 13, 19)
        out = 1
        for i, on in zip(idx, self.time_upscale):
            w = self.p[f"decoder.{i}.conv.weight"]
            out *= w.shape[0] // w.shape[1] if on else 1
        return out

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """[N, T, 3, H, W] in [0, 1] -> [N, T', C, h, w]."""
        video = video.to(torch.float64)
        frames = list(video.unbind(1))
        while len(frames) % self.t_downscale:
            frames.append(frames[-1])
        patch = round(math.sqrt(self.p["encoder.0.weight"].shape[1] / 3))
        frames = [_pixel_unshuffle(f, patch) if patch > 1 else f for f in frames]
        frames = [torch.relu(self._conv("encoder.0", f)) for f in frames]
        i = 2
        for _ in range(3):
            frames = self._tpool(f"encoder.{i}", frames)
            frames = [self._conv(f"encoder.{i + 1}", f, stride=2) for f in frames]
            for j in range(3):
                frames = self._mem(f"encoder.{i + 2 + j}", frames)
            i += 5
        return torch.stack([self._conv(f"encoder.{i}", f) for f in frames], 1)

    def decode_raw(self, latents: torch.Tensor) -> list:
        """[N, T, C, h, w] -> list of untrimmed, unclamped decoder outputs before the final pixel shuffle."""
        frames = list(latents.to(torch.float64).unbind(1))
        if not self.super:
            frames = [torch.relu(self._conv("decoder.1", torch.tanh(f / 3) * 3)) for f in frames]
            i = 3
            for stage in range(3):
                for j in range(3):
                    frames = self._mem(f"decoder.{i + j}", frames)
                if self.space_upscale[stage]:
                    frames = [f.repeat_interleave(2, 2).repeat_interleave(2, 3) for f in frames]
                frames = self._tgrow(f"decoder.{i + 4}", frames, self.time_upscale[stage])
                frames = [self._conv(f"decoder.{i + 5}", f) for f in frames]
                i += 6
            return [self._conv(f"decoder.{i + 1}", torch.relu(f)) for f in frames]
        frames = [F.conv2d(f, self._w("decoder.0.weight")) for f in frames]
        i = 1
        for stage in range(3):
            for j in range(3):
                frames = self._super_mem(f"decoder.{i + j}", frames)
            if self.space_upscale[stage]:
                frames = [_pixel_shuffle(torch.relu(self._conv(f"decoder.{i + 3}", f)), 2) for f in frames]
            else:
                w, b = self._w(f"decoder.{i + 3}.weight"), self._w(f"decoder.{i + 3}.bias")
                frames = [torch.relu(F.conv2d(f, w[0::4], b[0::4], padding=1)) for f in frames]
            frames = self._tgrow(f"decoder.{i + 6}", frames, self.time_upscale[stage])
            i += 7
        return [self._conv(f"decoder.{i}", f) for f in frames]

    def decode_video(self, latents: torch.Tensor, trim: bool = True) -> torch.Tensor:
        """[N, T, C, h, w] -> [N, t_up*T - (t_up - 1), 3, H, W] in [0, 1] (trim=False keeps all t_up*T)."""
        raw = self.decode_raw(latents)
        patch = round(math.sqrt(raw[0].shape[1] / 3))
        frames = [(_pixel_shuffle(f, patch) if patch > 1 else f).clamp(0, 1) for f in raw]
        if trim:
            frames = frames[self.t_upscale - 1:]
        return torch.stack(frames, 1)

    def unused_keys(self, part: str) -> list[str]:
        return sorted(k for k in self.p if k.startswith(part + ".") and k not in self.used)
