"""Benchmark section: TAEHV video decode against plain PyTorch with the same weights, side by side in one process.

    python -m taesd_fast.apps.bench --sections taehv [--workloads step,taew2_1] [--no-compile]

Workloads (fp16, batch 1, random weights in the published taew2_2 / taew2_1 layouts; speed does not depend on the
values): a whole Wan 2.2 5B clip (taew2_2, 31 latent frames of 48x44x80 -> 121 frames of 704x1280), upstream's
README clip (taew2_1, 16 latent frames of 16x40x64 -> 61 frames of 320x512), and one streaming step of each (one
latent frame -> 4 frames of 704x1280, or of 320x512).

Peers: `PlainTAEHVDecoder`, a straightforward PyTorch module written here from the published structure (nn.Conv2d,
cat[x, past], nearest upsample then TGrow then conv), loaded with the same state dict, run eager NCHW, eager
channels_last, channels_last as a CUDA graph, and torch.compile (default, max-autotune). For the step the peers
decode one latent frame in parallel (4 frames, untrimmed), the same work as one streaming step.
Ours: the user's own calls: `model.decode_video(latents)` (a replay of its whole-call CUDA graph from its second
call, as the model does by itself; and eagerly, `cuda_graphs = False`), and a `model.decode_step` stream (a graph
replay from its second step; and eagerly).

Every row's output is compared with the plain decoder in fp32 (TF32 off, decoded in chunks of latent frames so the
reference's memory stays small); a taesd_fast row whose relative error exceeds 2x PyTorch's own fp16 error posts no
time. Peak memory is torch.cuda.max_memory_allocated over the timed calls (reset per row). The rows are measured
cheapest first (every workload's eager and taesd_fast rows, then torch.compile default, then max-autotune, which
compiles for minutes) and each is printed as soon as it is measured, so a time-limited run keeps what it finished.
"""

from __future__ import annotations

import copy
import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...timing import time_ms

STREAM_PEAK_STEPS = (8, 32)  # the streaming step's peak memory after this many steps: it must not grow
CHECK_LATENT_FRAMES = 4  # a streaming step is checked over a stream of this many latent frames
REFERENCE_CHUNK = 4  # latent frames per chunk of the fp32 reference decode
PEER_PREFIXES = ("PyTorch", "torch.compile")
COLUMNS = ("workload", "method", "ms", "fps", "TFLOP/s", "x best peer", "peak GB", "rel err vs fp32", "note")


@dataclass(frozen=True)
class Workload:
    name: str
    variant: str  # taew2_2 | taew2_1 (both base decoders, 4x time upscale)
    latent_frames: int
    height: int  # latent cells
    width: int
    step: bool = False  # a streaming step of one latent frame, not a whole clip


WORKLOADS = [
    Workload("taew2_2 clip: 31 latents 44x80 -> 121 frames 704x1280", "taew2_2", 31, 44, 80),
    Workload("taew2_1 clip: 16 latents 40x64 -> 61 frames 320x512", "taew2_1", 16, 40, 64),
    Workload("taew2_2 step: 1 latent 44x80 -> 4 frames 704x1280", "taew2_2", 1, 44, 80, step=True),
    Workload("taew2_1 step: 1 latent 40x64 -> 4 frames 320x512", "taew2_1", 1, 40, 64, step=True),
]


# ------------------------------------------------------------------------------------------ plain PyTorch peer


class PlainClamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class PlainMemBlock(nn.Module):
    """relu(conv(relu(conv(relu(conv(cat[x, past]))))) + x), with the decoder's equal in and out widths."""

    def __init__(self, n: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * n, n, 3, padding=1), nn.ReLU(), nn.Conv2d(n, n, 3, padding=1),
                                  nn.ReLU(), nn.Conv2d(n, n, 3, padding=1))
        self.skip = nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class PlainTGrow(nn.Module):
    """A bias-free 1x1 conv to stride*C channels; channel block j becomes frame j (frames stay time-major)."""

    def __init__(self, n: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n, n * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nt, c, h, w = x.shape
        return self.conv(x).reshape(nt * self.stride, c, h, w)


class PlainTAEHVDecoder(nn.Sequential):
    """The published base TAEHV decoder (widths 256, 128, 64, 64) as plain PyTorch layers, with the published
    indices, so `load_state_dict(taehv.decoder.state_dict())` loads the same weights:

        Clamp, conv, ReLU, 3 x [3 MemBlocks, Upsample(2), TGrow, conv (no bias)], ReLU, conv(64 -> 3 p^2)

    then pixel shuffle by the patch size and clamp to [0, 1]. It runs in the weights' memory format (call
    `.to(memory_format=torch.channels_last)` for the channels_last peer). The benchmark's baseline, and (in fp32)
    the reference its rows are checked against."""

    def __init__(self, latent_channels: int, patch_size: int, decoder_time=(1, 2, 2)):
        widths = (256, 128, 64, 64)
        layers: list[nn.Module] = [PlainClamp(), nn.Conv2d(latent_channels, widths[0], 3, padding=1), nn.ReLU()]
        for stage, stride in enumerate(decoder_time):
            layers += [PlainMemBlock(widths[stage]) for _ in range(3)]
            layers += [nn.Upsample(scale_factor=2), PlainTGrow(widths[stage], stride),
                       nn.Conv2d(widths[stage], widths[stage + 1], 3, padding=1, bias=False)]
        layers += [nn.ReLU(), nn.Conv2d(widths[3], 3 * patch_size ** 2, 3, padding=1)]
        super().__init__(*layers)
        self.latent_channels, self.patch_size, self.decoder_time = latent_channels, patch_size, tuple(decoder_time)
        self.t_upscale = math.prod(decoder_time)

    def forward(self, latents: torch.Tensor, trim: bool = True, memory: list | None = None) -> torch.Tensor:
        """[N, T, C, h, w] latents -> [N, t_up*T (- t_up + 1 with trim), 3, H, W] frames in [0, 1].

        memory: None starts a video (each MemBlock's past is zeros at its first frame); a list (empty at the
        start) continues one: it holds each MemBlock's input at the last frame and is updated, so decoding a clip
        in chunks of latent frames gives the frames of decoding it whole (trim only the first chunk)."""
        n, t = latents.shape[:2]
        fmt = torch.channels_last if self[1].weight.is_contiguous(memory_format=torch.channels_last) \
            else torch.contiguous_format
        x = latents.reshape(n * t, *latents.shape[2:]).contiguous(memory_format=fmt)
        blocks = 0
        for layer in self:
            if isinstance(layer, PlainMemBlock):
                x = layer(x, self._past(x, n, memory, blocks))
                blocks += 1
            else:
                x = layer(x)
        x = F.pixel_shuffle(x, self.patch_size).clamp(0, 1)
        frames = x.reshape(n, -1, *x.shape[1:])
        return frames[:, self.t_upscale - 1:] if trim else frames

    @staticmethod
    def _past(x: torch.Tensor, n: int, memory: list | None, j: int) -> torch.Tensor:
        """x's frames shifted one step later in time: frame t's past is frame t-1 (the memory or zeros at t=0)."""
        frames = x.reshape(n, -1, *x.shape[1:])
        past = torch.empty_like(x)  # keeps x's memory format
        shifted = past.view(frames.shape)
        if memory is not None and j < len(memory):
            shifted[:, 0] = memory[j]
        else:
            shifted[:, 0] = 0
        shifted[:, 1:] = frames[:, :-1]
        if memory is not None:
            last = frames[:, -1].clone()
            memory[j:j + 1] = [last]
        return past

    def decode_in_chunks(self, latents: torch.Tensor, chunk: int, out_device="cpu") -> torch.Tensor:
        """forward(latents) computed `chunk` latent frames at a time, the frames gathered on out_device: the
        memory of a long clip's decode stays that of one chunk."""
        memory: list = []
        parts = [self(latents[:, i:i + chunk], trim=False, memory=memory).to(out_device)
                 for i in range(0, latents.shape[1], chunk)]
        return torch.cat(parts, 1)[:, self.t_upscale - 1:]


def plain_decoder_like(model) -> PlainTAEHVDecoder:
    """A PlainTAEHVDecoder with a base-decoder TAEHV's weights (fp32, on the CPU)."""
    arch = model.arch
    if arch.super_decoder:
        raise ValueError("PlainTAEHVDecoder is the base decoder; this model has a super decoder")
    plain = PlainTAEHVDecoder(arch.latent_channels, arch.patch_size, arch.decoder_time)
    plain.load_state_dict({k: v.detach().float().cpu().contiguous() for k, v in model.decoder.state_dict().items()})
    return plain.eval().requires_grad_(False)


def random_decoder(variant: str, seed: int = 0, encoder: bool = False):
    """A decoder-only TAEHV (with encoder=True, the whole model) in the published `variant` layout with random
    weights (fp32, CPU), scaled so activations keep their size through the network and most decoded pixels land
    inside (0, 1), where the final clamp does not hide differences between implementations."""
    from ...models.taehv.model import TAEHV

    model = TAEHV(variant, encoder=encoder)
    gen = torch.Generator().manual_seed(seed)
    for part in filter(None, (model.decoder, model.encoder)):
        convs = [m for m in part.modules() if isinstance(m, nn.Conv2d)]
        with torch.no_grad():
            for i, conv in enumerate(convs):
                last = part is model.decoder and i == len(convs) - 1
                fan_in = conv.weight[0].numel()
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * (0.3 if last else 1.0) / fan_in ** 0.5)
                if conv.bias is not None:
                    conv.bias.copy_(0.05 * torch.randn(conv.bias.shape, generator=gen) + (0.5 if last else 0.0))
    return model.eval().requires_grad_(False)


def decoder_flop(plain: PlainTAEHVDecoder, latent_shape) -> float:
    """FLOPs of the plain decoder on latents of this shape (counted by PyTorch on meta tensors: no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        meta = PlainTAEHVDecoder(plain.latent_channels, plain.patch_size, plain.decoder_time)
        latents = torch.empty(latent_shape)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(latents, trim=False)
    return float(counter.get_total_flops())


# ------------------------------------------------------------------------------------------ measurement


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"the taehv benchmark needs a CUDA GPU; torch {torch.__version__} sees none")


@contextmanager
def _fp32_exact():
    """fp32 convs and matmuls without TF32, so the reference is a true fp32 computation."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, frame by frame on out's device (ref may be a large CPU tensor)."""
    return errors(out, ref)[1]


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, ||out - ref|| / ||ref||), frame by frame on out's device (ref may be a large CPU tensor)."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    num = den = worst = 0.0
    for o, r in zip(out.unbind(1), ref.unbind(1)):
        r = r.to(o.device, torch.float32)
        diff = o.float() - r
        num += diff.square().sum().item()
        den += r.square().sum().item()
        worst = max(worst, diff.abs().max().item())
    return worst, math.sqrt(num / den)


def withhold_if_wrong(entry: dict, torch_fp16_err: float) -> dict:
    """A taesd_fast row whose error against fp32 exceeds 2x PyTorch's own fp16 error (plus 1e-6 for rounding
    noise, as the GPU tests allow; or is NaN) keeps no time: a wrong fast path must not post a speed."""
    err = entry["rel err vs fp32"]
    if not err <= 2 * torch_fp16_err + 1e-6:
        entry["note"] = f"WRONG OUTPUT: rel err {err:.3g} > 2x PyTorch fp16's {torch_fp16_err:.3g}; time withheld"
        for key in ("ms", "fps", "TFLOP/s"):
            entry[key] = None
    return entry


def _graph_of(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """fn() captured in a CUDA graph (taesd_fast.graphs.capture) on the first call, inside the row's error
    handling; each call replays it and returns its output buffer."""
    from ...graphs import capture

    graph: list = []

    def run() -> torch.Tensor:
        if not graph:
            graph.extend(capture(fn))
        replay, output = graph
        replay()
        return output

    return run


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _measure(fn: Callable[[], torch.Tensor], check: Callable[[], float]) -> dict:
    """ms per call (median, after warm-up), peak GB over the timed calls, and the check's relative error."""
    fn(), fn()  # warm-up: compilation, tuning, graph captures
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(fn)
    peak = torch.cuda.max_memory_allocated() / 1e9
    return {"ms": ms, "peak GB": peak, "rel err vs fp32": check()}


def _stream_peak(model, latents: torch.Tensor, steps: int) -> float:
    """Peak GB while a fresh decode_step stream runs `steps` steps (cycling through latents' frames)."""
    _release()
    torch.cuda.reset_peak_memory_stats()
    state = None
    for i in range(steps):
        frames, state = model.decode_step(latents[:, i % latents.shape[1]], state)
        del frames
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e9
    del state
    return peak


def _stream(model, latents: torch.Tensor) -> torch.Tensor:
    """decode_step over every latent frame of a fresh stream, the frames concatenated."""
    state, out = None, []
    for t in range(latents.shape[1]):
        frames, state = model.decode_step(latents[:, t], state)
        out.append(frames)
    return torch.cat(out, 1)


class _Setup:
    """One workload's models, inputs and fp32 references."""

    def __init__(self, work: Workload, seed: int):
        gen = torch.Generator().manual_seed(seed)
        model = random_decoder(work.variant, seed)
        plain32 = plain_decoder_like(model).cuda()
        self.plain16 = copy.deepcopy(plain32).half()
        self.plain16_cl = copy.deepcopy(self.plain16).to(memory_format=torch.channels_last)
        self.model = model.cuda().half()
        c = model.latent_channels
        z = torch.randn(1, work.latent_frames, c, work.height, work.width, generator=gen)
        z_check = torch.randn(1, CHECK_LATENT_FRAMES, c, work.height, work.width, generator=gen) if work.step else z
        self.z, self.z_check = z.cuda().half(), z_check.cuda().half()
        self.flop = decoder_flop(plain32, z.shape)
        self.out_frames = 4 * work.latent_frames - (0 if work.step else 3)
        with torch.no_grad(), _fp32_exact():  # of the fp16 inputs (fp16 values are exact in fp32)
            # ref_timed: what the timed peer call gives (for a step: one latent frame decoded untrimmed);
            # ref_check: what the taesd_fast rows are checked against (for a step: a stream of a few latents).
            self.ref_check = plain32.decode_in_chunks(self.z_check.float(), REFERENCE_CHUNK)
            self.ref_timed = plain32(self.z.float(), trim=False).cpu() if work.step else self.ref_check
        del plain32
        with torch.no_grad():
            self.torch_fp16_err = rel_err(self.plain16(self.z_check), self.ref_check)
        inside = ((self.ref_check > 0) & (self.ref_check < 1)).float().mean().item()
        self.note = f"reference pixels inside (0, 1): {inside:.0%}"

    def peers(self, work: Workload, compile_mode: str | None) -> dict[str, tuple]:
        """{method: (fn, check)} of the plain PyTorch rows (or the one torch.compile row of compile_mode)."""
        z, trim = self.z, not work.step

        def check(fn):
            return lambda: rel_err(fn(), self.ref_timed)

        if compile_mode is not None:
            compiled = torch.compile(copy.deepcopy(self.plain16_cl), mode=compile_mode)
            fn = lambda: compiled(z, trim=trim)  # noqa: E731
            return {f"torch.compile {compile_mode}": (fn, check(fn))}
        nchw = lambda: self.plain16(z, trim=trim)  # noqa: E731
        cl = lambda: self.plain16_cl(z, trim=trim)  # noqa: E731
        rows = {"PyTorch eager NCHW": (nchw, check(nchw)), "PyTorch eager channels_last": (cl, check(cl))}
        graphed = _graph_of(cl)
        rows["PyTorch channels_last + CUDA graph"] = (graphed, check(graphed))
        return rows

    def ours(self, work: Workload) -> dict[str, tuple]:
        model, z = self.model, self.z
        if not work.step:
            rows = {}
            for label, graphs_on in (("", True), (", eager", False)):
                def call(graphs_on=graphs_on):
                    model.cuda_graphs = graphs_on
                    return model.decode_video(z)

                rows[f"taesd_fast decode_video{label}"] = (call, lambda call=call: rel_err(call(), self.ref_check))
            return rows
        rows = {}
        for label, graphs_on in (("graph replay", True), ("eager", False)):
            stream = {"state": None}

            def step(graphs_on=graphs_on, stream=stream):
                model.cuda_graphs = graphs_on
                frames, stream["state"] = model.decode_step(z[:, 0], stream["state"])
                return frames

            def check(graphs_on=graphs_on):
                model.cuda_graphs = graphs_on
                return rel_err(_stream(model, self.z_check), self.ref_check)

            rows[f"taesd_fast decode_step ({label})"] = (step, check)
        return rows


def _run_rows(row, work: Workload, methods: dict) -> None:
    """row() for each method, dropping each one's closures (and the CUDA graphs or compiled code they hold) before
    the next row, so no row's peak memory carries another's."""
    for method in list(methods):
        fn, check = methods.pop(method)
        row(work, method, fn, check)
        del fn, check
        _release()


def bench_taehv(workloads=None, compile_modes=("default", "max-autotune")) -> list[dict]:
    """Rows of {workload, method, ms, fps, TFLOP/s, peak GB, rel err vs fp32, x best peer, note}."""
    require_cuda()
    torch.backends.cudnn.benchmark = True
    workloads = list(WORKLOADS if workloads is None else workloads)
    results: dict[str, list[dict]] = {w.name: [] for w in workloads}
    setups: dict[str, _Setup] = {}

    def row(work: Workload, method: str, fn, check) -> None:
        setup = setups[work.name]
        entry = {"workload": work.name, "method": method}
        try:
            with torch.no_grad():
                entry.update(_measure(fn, check))
            entry["fps"] = setup.out_frames * 1000.0 / entry["ms"]
            entry["TFLOP/s"] = setup.flop / entry["ms"] / 1e9
            if method.startswith("taesd_fast"):
                withhold_if_wrong(entry, setup.torch_fp16_err)
        except Exception as err:  # a peer that cannot run here (torch.compile missing, out of memory) is reported
            entry["note"] = _failure(err)
        results[work.name].append(entry)
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()
                          if k not in ("workload", "method") and v is not None)
        print(f"  {work.name} | {method}: {shown}", flush=True)

    for index, work in enumerate(workloads):  # the eager peers and ours: seconds per workload
        try:
            setups[work.name] = setup = _Setup(work, seed=index)
        except Exception as err:  # e.g. a GPU too small for the fp16 or fp32 reference decode
            results[work.name].append({"workload": work.name, "method": "setup", "note": _failure(err)})
            print(f"  {work.name}: setup {_failure(err)}", flush=True)
            _release()
            continue
        print(f"  {work.name}: {setup.flop / 1e12:.2f} TFLOP (plain decoder), PyTorch fp16 rel err "
              f"{setup.torch_fp16_err:.3g}, {setup.note}", flush=True)
        _run_rows(row, work, {**setup.peers(work, None), **setup.ours(work)})
        if work.step:
            with torch.no_grad():
                setup.model.cuda_graphs = True
                peaks = [_stream_peak(setup.model, setup.z_check, n) for n in STREAM_PEAK_STEPS]
            grows = peaks[1] > peaks[0] * 1.005 + 2 ** 20 / 1e9
            results[work.name].append({
                "workload": work.name, "method": "taesd_fast decode_step stream peak", "peak GB": peaks[1],
                "note": f"{STREAM_PEAK_STEPS[0]} steps {peaks[0]:.4f} GB, {STREAM_PEAK_STEPS[1]} steps "
                        f"{peaks[1]:.4f} GB: " + ("GROWS with the stream's length" if grows else "bounded")})
            print(f"  {work.name} | stream peak: {results[work.name][-1]['note']}", flush=True)
    for mode in compile_modes:  # minutes each: last, so a time limit cuts these first
        for work in workloads:
            if work.name not in setups:
                continue
            torch._dynamo.reset()
            try:
                peers = setups[work.name].peers(work, mode)
            except Exception as err:
                results[work.name].append({"workload": work.name, "method": f"torch.compile {mode}",
                                           "note": _failure(err)})
                continue
            _run_rows(row, work, peers)
            torch._dynamo.reset()
    rows = []
    for work in workloads:
        group = results[work.name]
        peer_ms = [r["ms"] for r in group if r["method"].startswith(PEER_PREFIXES) and r.get("ms")]
        best = min(peer_ms, default=None)
        for r in group:
            if best and r.get("ms"):
                r["x best peer"] = best / r["ms"]
            rows.append({k: r[k] for k in COLUMNS if r.get(k) is not None})  # a withheld time shows blank
    return rows


def _failure(err: Exception) -> str:
    text = str(err).strip()
    return f"failed: {type(err).__name__}" + (f": {text.splitlines()[0]}" if text else "")


def section(args) -> list[dict]:
    """`python -m taesd_fast.apps.bench --sections taehv`: --workloads filters by name substrings, --no-compile skips
    the torch.compile rows."""
    wanted = [w.strip() for w in (args.workloads or "").split(",") if w.strip()]
    workloads = [w for w in WORKLOADS if not wanted or any(s in w.name for s in wanted)]
    if not workloads:
        raise SystemExit(f"error: --workloads {args.workloads!r} matches no taehv workload; names: "
                         + "; ".join(w.name for w in WORKLOADS))
    return bench_taehv(workloads, compile_modes=() if args.no_compile else ("default", "max-autotune"))
