"""TAEHV: madebyollin's tiny video autoencoders (taew2_2, taew2_1, taehv, taehv1_5, taecvx, taeos1_3, taeltx_2,
taeltx2_3 and the _super decoders), with upstream state_dict keys, a whole-video path and a streaming step.

Video is NTCHW ([N, T, 3, H, W]) in [0, 1]; latents are NTCHW as the diffusion model makes them (no scaling).
The streaming step carries explicit state and has fixed shapes per (batch, size), so on CUDA it is replayed as a
CUDA graph from its second call with a state on.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import dispatch, graphs
from ...graphs import GraphCache, parameters_of
from ...validation import as_float_dtype, check_device
from ...value_range import warn_if_unusual_range
from ..layers import TinyAutoencoder, preferred_format, preferred_layout
from .hub import VARIANTS, choose_name, detect, known_variant, resolve, split_parts
from .layers import TAEHVArch, build_decoder, build_encoder, narrow_frames
from .sequence import Preview, live_elements, memory_indices, run_sequence, sizes_at
from .stream import StreamState, check_video, graphed_step, replayable

CHUNK_BYTES = 3 << 29  # 1.5 GiB of activations per chunk of decode_video / encode_video (TAEHV.chunk_bytes)


class TAEHV(TinyAutoencoder):
    """Tiny video autoencoder. `encoder` / `decoder` are nn.Sequentials keyed as upstream (`encoder.0.weight`,
    `decoder.3.conv.0.weight`, ...), so a published .pth / .safetensors file loads into `load_state_dict` as is.

    Preview knobs (`set_preview`): switch each decoder stage's time or space upscaling off for a cheaper decode.
    cuda_graphs (default True): on CUDA, `decode_step` / `encode_step` replay a CUDA graph from a stream's second
    step with the same input shape on; `decode_video` / `encode_video` replay one of the whole call from the second
    call with the same input shape and flags on, where the clip's frames (the decode's output, the encode's input)
    take at most half of `chunk_bytes`. Eager calls wait for their ~200 kernel launches: a replay has none. A
    replayed call's graph holds its own copy of those frames and one chunk's activations until the model moves
    (`.to()`) or another shape takes its place (the last 2 are kept); set cuda_graphs = False for eager calls.
    chunk_bytes (default CHUNK_BYTES): `decode_video` / `encode_video` run as many latent frames at a time as keep
    the estimated activations within this many bytes (at least one), so their memory is the output's plus one
    chunk's at any video length; the result does not depend on it.
    """

    def __init__(self, variant: str | TAEHVArch = "taew2_1", encoder: bool = True, decoder: bool = True):
        arch, name = (variant, None) if isinstance(variant, TAEHVArch) else (VARIANTS[known_variant(variant)], variant)
        super().__init__(arch, name, build_encoder(arch) if encoder else None, build_decoder(arch) if decoder else None,
                         graph_caches={"encoder": GraphCache(max_graphs=2), "decoder": GraphCache(max_graphs=2)})
        self.preview = Preview()
        self.chunk_bytes = CHUNK_BYTES

    # ------------------------------------------------------------------------------------------ properties

    @property
    def patch_size(self) -> int:
        return self.arch.patch_size

    @property
    def t_downscale(self) -> int:
        """Video frames per latent frame in the encoder."""
        return self.arch.t_downscale

    @property
    def t_upscale(self) -> int:
        """Frames each latent frame decodes to, with the preview knobs applied."""
        return _stride_product(self.arch.decoder_time, self.preview.time)

    @property
    def frames_to_trim(self) -> int:
        """Startup frames dropped from the front of a decode: t_upscale - 1."""
        return self.t_upscale - 1

    @property
    def space_upscale(self) -> int:
        """Output pixels per latent cell along each side, with the preview knobs applied."""
        return self.patch_size * _stride_product((2, 2, 2), self.preview.space)

    def set_preview(self, time_upscale=None, space_upscale=None) -> "TAEHV":
        """Turn the decoder's per-stage upscaling off (False) or back on (True); None leaves all stages on.

        Tuples of 3 flags, one per decoder stage; 2 flags name the last two stages (upstream's convention, where
        the first stage of the 4x-time models has no time upscale). Turning on a time upscale the weights do not
        have is an error. Returns self."""
        time = _flags(time_upscale, "time_upscale")
        for stage, (on, stride) in enumerate(zip(time, self.arch.decoder_time)):
            if on and stride == 1 and time_upscale is not None and len(tuple(time_upscale)) == 3:
                raise ValueError(f"time_upscale[{stage}]=True, but this {self.variant or 'model'}'s decoder stage "
                                 f"{stage} has no time upscale (its strides are {self.arch.decoder_time})")
        self.preview = Preview(time, _flags(space_upscale, "space_upscale"))
        return self

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike | None = None,
        *,
        variant: str | None = None,
        encoder: bool = True,
        decoder: bool = True,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> "TAEHV":
        """Load published weights.

        name_or_path: a variant name ("taew2_2") or None with variant=, both meaning the Hub repo madebyollin/taehv;
            another Hub repo id (with variant=); a local folder holding <variant>.safetensors / .pth; or a file.
        variant: picks the file in a repo or folder, and must agree with the tensors (latent channels, patch size,
            base/super decoder), which decide the architecture; for variants with identical tensors (taehv,
            taew2_1, taeos1_3, taecvx) it or the file name sets the name (taecvx decodes even latent counts
            untrimmed, as upstream does).
        encoder / decoder: False skips that part (a file without it loads as decoder- or encoder-only).
        Returns the model in eval mode with requires_grad off. HF_HUB_OFFLINE=1 is honoured by huggingface_hub.
        """
        device = check_device(device)  # a clear error for CUDA on a CPU-only torch, before any download
        state, source, hint = resolve(name_or_path, variant=variant, revision=revision, cache_dir=cache_dir,
                                      local_files_only=local_files_only)
        return cls.from_state_dict(state, variant=variant, name_hint=hint, source=source, encoder=encoder,
                                   decoder=decoder, dtype=dtype, device=device)

    @classmethod
    def from_state_dict(cls, state: dict, *, variant: str | None = None, name_hint: str | None = None,
                        source: str = "the state dict", encoder: bool = True, decoder: bool = True,
                        dtype=None, device=None) -> "TAEHV":
        """The model for an upstream-keyed state dict already in memory (architecture read from the tensors)."""
        dtype, device = as_float_dtype(dtype), check_device(device)
        enc, dec = split_parts(state, source)
        enc, dec = (enc if encoder else None), (dec if decoder else None)
        if enc is None and dec is None:
            raise ValueError(f"{source} has no {'encoder' if encoder else 'decoder'} weights to load")
        arch = detect(enc, dec, source)
        model = cls(arch, encoder=enc is not None, decoder=dec is not None)
        model.variant = choose_name(arch, variant, name_hint, source)
        for part, sub in (("encoder", enc), ("decoder", dec)):
            if sub is not None:
                getattr(model, part).load_state_dict(sub)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------------ whole video

    def encode_video(self, video: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False) -> torch.Tensor:
        """[N, T, 3, H, W] in [0, 1] -> [N, ceil(T / t_downscale), C, H / (8p), W / (8p)] latents.

        The end is padded with copies of the last frame up to a multiple of t_downscale. The frames run through the
        streaming state in chunks sized by `chunk_bytes` (the latents equal a whole-video encode's), so memory
        does not grow with the video's length; parallel=False encodes t_downscale frames at a time. On CUDA the call
        is a CUDA-graph replay from its second call with this shape (cuda_graphs, class docstring)."""
        param = self._param("encoder")
        check_video(video, "video", 3, param, self.arch.space_scale)
        warn_if_unusual_range(video, checked=self._range_checked, what="video frames")
        run = lambda frames: self._encode_video(frames, parallel, show_progress_bar, param)  # noqa: E731
        if not self._whole_call_graph(video.numel() * video.element_size(), show_progress_bar):
            return run(video)
        with torch.no_grad():
            return self._graph_caches["encoder"](run, video, parameters_of(self.encoder),
                                                 extra=(parallel, self.chunk_bytes))

    def _encode_video(self, video: torch.Tensor, parallel: bool, show_progress_bar: bool,
                      param: torch.Tensor) -> torch.Tensor:
        n, _, _, h, w = video.shape
        steps, side = -(-video.shape[1] // self.t_downscale), self.arch.space_scale
        out = torch.empty(n, steps, self.latent_channels, h // side, w // side, dtype=param.dtype,
                          device=param.device)
        # The full-resolution layers (through the first stage's memory blocks) run on short chunks of latent
        # frames; their output, 16x smaller per frame, is gathered into long chunks for the low-resolution layers,
        # whose convs would otherwise get a few frames each. The mirror of _decode_video's two levels.
        long, short, cut = self._encode_chunks(steps, h, w, param, parallel)
        state = self._state("encoder", None, n, h, w, param)
        with torch.no_grad():
            for start, stop in _progress(chunk_spans(steps, long), show_progress_bar, "encoding"):
                spans = chunk_spans(stop - start, short)
                mid = None
                for a, b in spans:
                    x = self._encoder_input(self._frames(video, start + a, start + b))
                    y = run_sequence(self.encoder, x, n, state.memory, stop=cut)
                    if len(spans) == 1:
                        mid = y
                        break
                    if mid is None:  # [n * frames, C, H, W] in y's layout, frames per sample in order
                        per = y.shape[0] // (n * (b - a))
                        mid = torch.empty((n * (stop - start) * per, *y.shape[1:]), dtype=y.dtype, device=y.device,
                                          memory_format=preferred_format(y.device))
                    mid.view(n, -1, *y.shape[1:])[:, a * per:b * per] = y.view(n, -1, *y.shape[1:])
                    del y  # not alive while the next chunk runs
                latents = run_sequence(self.encoder, mid, n, state.memory, start=cut)
                out[:, start:stop] = latents.view(n, stop - start, *latents.shape[1:])
                del mid
        return out

    def _frames(self, video: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The frames of latent frames start..stop-1, the end padded with copies of the video's last frame."""
        td = self.t_downscale
        frames = video[:, start * td:stop * td]
        pad = (stop - start) * td - frames.shape[1]
        if pad:
            frames = torch.cat([frames, frames[:, -1:].expand(-1, pad, -1, -1, -1)], 1)
        return frames

    def _encoder_input(self, video: torch.Tensor) -> torch.Tensor:
        """[N, T, 3, H, W] -> the encoder's input [N*T, 3p^2, H/p, W/p] (pixel-unshuffled, in the preferred layout)."""
        n, t, _, h, w = video.shape
        x = video.reshape(n * t, 3, h, w)
        if self.patch_size > 1:
            x = F.pixel_unshuffle(x, self.patch_size)
        return preferred_layout(x)  # after the unshuffle, whose output is NCHW

    def decode_video(self, latents: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False,
                     uint8: bool = False) -> torch.Tensor:
        """[N, T, C, h, w] latents -> [N, t_upscale*T - frames_to_trim, 3, H, W] frames in [0, 1] (4T - 3 for the
        4x-time models; taecvx keeps all 4T frames when T is even, as upstream).

        The latent frames run through the streaming state in chunks whose activations fit `chunk_bytes`: long
        chunks through the low-resolution layers, their output in short chunks through the last stage, each
        chunk's frames written into the one output tensor. The frames equal a whole-video decode's, and memory
        beyond the output does not grow with the video's length. parallel=False decodes one latent frame at a time.
        uint8: frames as uint8 in [0, 255] (rounded), for writing video (half or a quarter of the output memory).
        On CUDA the call is a CUDA-graph replay from its second call with this shape (cuda_graphs, class docstring)."""
        param = self._param("decoder")
        check_video(latents, "latents", self.latent_channels, param)
        n, t, c, h, w = latents.shape
        trim = 0 if self._untrimmed(t) else self.frames_to_trim
        side = self.space_upscale
        shape = (n, self.t_upscale * t - trim, 3, h * side, w * side)
        dtype = torch.uint8 if uint8 else param.dtype
        run = lambda z: self._decode_video(z, shape, dtype, trim, parallel, show_progress_bar, param)  # noqa: E731
        if not self._whole_call_graph(math.prod(shape) * dtype.itemsize, show_progress_bar):
            return run(latents)
        with torch.no_grad():
            return self._graph_caches["decoder"](run, latents, parameters_of(self.decoder),
                                                 extra=(parallel, uint8, self.preview, self.chunk_bytes))

    def _decode_video(self, latents: torch.Tensor, shape: tuple, dtype: torch.dtype, trim: int, parallel: bool,
                      show_progress_bar: bool, param: torch.Tensor) -> torch.Tensor:
        n, t, c, h, w = latents.shape
        uint8 = dtype == torch.uint8
        out = torch.empty(shape, dtype=dtype, device=param.device)
        # The layers before the last stage's memory blocks run on long chunks of latent frames (their activations
        # are small, and short chunks would leave their convs too little work); their output is then cut into short
        # chunks of frames for the full-resolution layers. The memory blocks carry each frame's past across both.
        outer, inner, cut = self._decode_chunks(t, h, w, param, parallel)
        state = self._state("decoder", None, n, h, w, param)
        written, to_skip = 0, trim
        with torch.no_grad():
            for start, stop in _progress(chunk_spans(t, outer), show_progress_bar, "decoding"):
                x = preferred_layout(latents[:, start:stop].reshape(n * (stop - start), c, h, w))
                mid = run_sequence(self.decoder, x, n, state.memory, self.preview, stop=cut)
                mid = mid.view(n, -1, *mid.shape[1:])
                for a, b in chunk_spans(mid.shape[1], inner):
                    y = run_sequence(self.decoder, preferred_layout(mid[:, a:b].flatten(0, 1)), n, state.memory,
                                     self.preview, start=cut, stop=len(self.decoder) - 1)
                    produced = y.shape[0] // n
                    skip = min(to_skip, produced)
                    to_skip -= skip
                    self._last_conv_frames(y, uint8, into=out[:, written:written + produced - skip], skip=skip)
                    written += produced - skip
                    del y  # not alive while the next chunk runs
                del mid
        return out

    def _whole_call_graph(self, frame_bytes: int, show_progress_bar: bool) -> bool:
        """Whether a decode_video / encode_video call goes through its whole-call graph cache (which runs CPU and
        autograd calls eagerly): with cuda_graphs on, without a progress bar (a replay has no steps to show), and
        where the clip's frames take at most half of chunk_bytes (the graph keeps its own copy of them, so memory
        stays bounded)."""
        return self.cuda_graphs and not show_progress_bar and frame_bytes <= self.chunk_bytes / 2

    def _decode_chunks(self, total: int, h: int, w: int, param: torch.Tensor,
                       parallel: bool = True) -> tuple[int, int, int]:
        """(latent frames per chunk of the layers before `cut`, frames per chunk of the layers from `cut` on, cut):
        one latent frame at a time without `parallel`; the whole clip at once where its activations fit
        `chunk_bytes`; else long chunks whose activations fit it, and short chunks whose activations fit it beside
        the long chunk's output."""
        seq, c_in, size = self.decoder, self.latent_channels, param.element_size()
        cut = memory_indices(seq)[-3]
        c, px, f = sizes_at(seq, c_in, h, w, cut, preview=self.preview)
        if not parallel:
            return 1, f, cut
        if total * self._bytes_per_latent("decoder", h, w, param) <= self.chunk_bytes:
            return total, total * f, cut  # the whole clip at once: every conv gets the most work per launch
        low = live_elements(seq, c_in, h, w, preview=self.preview, stop=cut) * size
        low_out = c * px * f * size  # per latent frame
        high = live_elements(seq, c_in, h, w, preview=self.preview, output_copies=3, start=cut) * size / f
        outer = max(1, int(min(total, self.chunk_bytes / low, self.chunk_bytes / 2 / low_out)))
        inner = max(1, int(min(outer * f, (self.chunk_bytes - outer * low_out) / high)))
        return outer, inner, cut

    def _encode_chunks(self, total: int, h: int, w: int, param: torch.Tensor,
                       parallel: bool = True) -> tuple[int, int, int]:
        """(latent frames per chunk of the layers from `cut` on, latent frames per chunk of the layers before `cut`,
        cut) for an h x w video: one latent frame at a time without `parallel`; the whole clip at once where its
        activations fit `chunk_bytes`; else long chunks whose gathered input and activations fit it (the input at
        most half), and short chunks whose activations fit it beside the long chunk's gathered input."""
        seq, p, td, size = self.encoder, self.patch_size, self.t_downscale, param.element_size()
        cut = memory_indices(seq)[3]  # the second stage's first memory block: its input is 16x smaller per frame
        if not parallel:
            return 1, 1, cut
        if total * self._bytes_per_latent("encoder", h, w, param) <= self.chunk_bytes:
            return total, total, cut
        c, px, f = sizes_at(seq, 3 * p * p, h // p, w // p, cut, frames=td)
        gathered = c * px * f * size  # per latent frame
        low = live_elements(seq, 3 * p * p, h // p, w // p, frames=td, start=cut) * size
        high = self._encoder_elements(h, w, stop=cut) * size
        long = max(1, int(min(total, self.chunk_bytes / (gathered + low), self.chunk_bytes / 2 / gathered)))
        short = max(1, int(min(long, (self.chunk_bytes - long * gathered) / high)))
        return long, short, cut

    def _bytes_per_latent(self, part: str, h: int, w: int, param: torch.Tensor) -> int:
        """Activation bytes alive at once per latent frame of an h x w input (estimated by `live_elements`)."""
        seq = getattr(self, part)
        if part == "decoder":
            elements = live_elements(seq, self.latent_channels, h, w, preview=self.preview, output_copies=3)
        else:
            elements = self._encoder_elements(h, w)
        return elements * param.element_size()

    def _encoder_elements(self, h: int, w: int, stop: int | None = None) -> int:
        """Elements alive at once per latent frame in encoder[:stop] for an h x w video: t_downscale frames,
        unshuffled into patches; the chunk's input frames and their copy count too."""
        p, td = self.patch_size, self.t_downscale
        return live_elements(self.encoder, 3 * p * p, h // p, w // p, frames=td, stop=stop) + 2 * 3 * h * w * td

    def _untrimmed(self, latent_frames: int | None) -> bool:
        """taecvx: upstream skips the startup trim for even latent counts (and always when streaming)."""
        return self.variant == "taecvx" and (latent_frames is None or latent_frames % 2 == 0)

    # ------------------------------------------------------------------------------------------ streaming

    def decode_step(self, latents: torch.Tensor, state: StreamState | None = None, uint8: bool = False):
        """One streaming step: latents [N, C, h, w] (one latent frame) or [N, k, C, h, w] -> (frames
        [N, t_upscale*k, 3, H, W], state). Start with state=None; the first step returns t_upscale - 1 fewer frames
        (the startup trim), so the steps of a video concatenate to `decode_video`. The state is updated in place and
        returned; memory does not grow with the stream's length."""
        param = self._param("decoder")
        if isinstance(latents, torch.Tensor) and latents.dim() == 4:
            latents = latents.unsqueeze(1)
        check_video(latents, "latents", self.latent_channels, param)
        first = state is None or getattr(state, "steps", None) == 0  # (a wrong state is reported below)
        frames, state = self._decode(latents, state, uint8, param)
        if first and not self._untrimmed(None):
            frames = frames[:, self.frames_to_trim:]
        return frames, state

    def encode_step(self, video: torch.Tensor, state: StreamState | None = None):
        """One streaming step: video [N, k * t_downscale, 3, H, W] in [0, 1] -> (latents [N, k, C, h, w], state).
        Start with state=None; pad the end of a video yourself (repeat its last frame), as `encode_video` does."""
        param = self._param("encoder")
        check_video(video, "video", 3, param, self.arch.space_scale)
        warn_if_unusual_range(video, checked=self._range_checked, what="video frames")
        if video.shape[1] % self.t_downscale:
            raise ValueError(f"encode_step takes a multiple of {self.t_downscale} frames (the encoder's time "
                             f"downscale), got {video.shape[1]}; pad with copies of the last frame")
        return self._encode(video, state, param)

    def _encode(self, video: torch.Tensor, state: StreamState | None, param: torch.Tensor):
        n, t, _, h, w = video.shape
        state = self._state("encoder", state, n, h, w, param)
        out = self._stream(self.encoder, self._encoder_input(video), state)
        return out.reshape(n, t // self.t_downscale, *out.shape[1:]), state

    def _decode(self, latents: torch.Tensor, state: StreamState | None, uint8: bool, param: torch.Tensor):
        """Decode a step's latent frames on the stream's state (a graph replay on CUDA from the second step)."""
        n, k, c, h, w = latents.shape
        state = self._state("decoder", state, n, h, w, param)
        x = preferred_layout(latents.reshape(n * k, c, h, w))
        out = self._stream(self.decoder, x, state, uint8=uint8)
        return out.reshape(n, -1, *out.shape[1:]), state

    def _state(self, part: str, state: StreamState | None, n: int, h: int, w: int, param) -> StreamState:
        preview = self.preview if part == "decoder" else None
        signature = (n, h, w, param.dtype, param.device, preview)
        if state is None:
            return StreamState(part, signature, [None] * len(memory_indices(getattr(self, part))))
        if not isinstance(state, StreamState) or state.part != part:
            other = f" for the {state.part}" if isinstance(state, StreamState) else ""
            raise TypeError(f"state must be what the last {part[:-1]}_step returned (or None), got "
                            f"{type(state).__name__}{other}")
        if state.signature != signature:
            raise ValueError(f"this state was made for {_describe(state.signature)} but the input is "
                             f"{_describe(signature)}; start a new stream with state=None")
        return state

    def _stream(self, seq: nn.Sequential, x: torch.Tensor, state: StreamState, uint8: bool = False) -> torch.Tensor:
        """run_sequence on the state's memory (then the decoder's postprocess) for a streaming step: on CUDA, a
        graph replay from the second call with this shape on. (decode_video / encode_video call run_sequence
        themselves, eagerly or inside their whole-call graph.)"""
        batch = state.signature[0]
        preview = self.preview if state.part == "decoder" else None
        post = state.part == "decoder"
        # A decoder step of one latent frame holds every block's input until its end (~60 MB for taew2_2 at
        # 704x1280) and writes the memory from there: on CUDA on the side stream beside later layers, else in one
        # copy; longer steps and the encoder's full-resolution blocks copy as they go, so their peak does not grow.
        batch_memory = post and x.shape[0] == batch
        # On CUDA, a decoder step computes its single-frame memory blocks' memory halves on a side stream (not while
        # torch.compile traces: it would have to trace the streams and events).
        project = post and x.is_cuda and not torch.compiler.is_compiling()

        def step(inp: torch.Tensor) -> torch.Tensor:
            if not post:
                return run_sequence(seq, inp, batch, state.memory, batch_memory=batch_memory)
            out = run_sequence(seq, inp, batch, state.memory, preview, stop=len(seq) - 1, batch_memory=batch_memory,
                               project=project)
            nk, _, h, w = out.shape
            p = self.patch_size
            frames = torch.empty((batch, nk // batch, 3, h * p, w * p), device=out.device,
                                 dtype=torch.uint8 if uint8 else out.dtype)
            return self._last_conv_frames(out, uint8, into=frames).flatten(0, 1)

        with torch.no_grad():
            if not (self.cuda_graphs and replayable(x)):
                out = step(x)
            else:
                with torch.cuda.device(x.device):  # capture and replay on the input's GPU
                    out = graphed_step(step, x, graphs.parameters_of(seq), state, uint8)
        state.steps += 1
        return out

    def _last_conv_frames(self, h: torch.Tensor, uint8: bool, into: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """The decoder's last conv on h (its input, [N*k, C, h, w]) and the output frames from it, written into
        `into` as _postprocess writes them: in one kernel where the dispatcher decided cuda_conv_narrow for that conv
        (layers.narrow_frames), else the conv, then _postprocess. Returns `into`."""
        last = self.decoder[-1]
        if narrow_frames(last, h, into, skip):
            return into
        return self._postprocess(last(h), uint8, into=into, skip=skip)

    def _postprocess(self, out: torch.Tensor, uint8: bool, into: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """The decoder's output [N*k, 3p^2, h, w] -> frames: pixel shuffle, clamp to [0, 1], uint8 if asked, written
        into `into` ([N, k - skip, 3, H, W]) without the first `skip` frames of each sample. Returns `into`. On CUDA
        one Triton pass (kernels/triton_frames.py); else the clamp reads `out` through the pixel shuffle's
        permutation and writes `into` (no shuffled copy). Both give the same values."""
        if _frames_kernel_takes(out, into, self.patch_size, skip):
            from ...kernels.triton_frames import write_frames

            return write_frames(out, into, self.patch_size, skip)
        n, k2 = into.shape[:2]
        p, (h, w) = self.patch_size, out.shape[2:]
        # pixel_shuffle: channel c*p*p + dy*p + dx of (y, x) is pixel (y*p + dy, x*p + dx) of channel c.
        frames = out.view(n, -1, 3, p, p, h, w)[:, skip:].permute(0, 1, 2, 5, 3, 6, 4)
        target = into.view(n, k2, 3, h, p, w, p)
        if not uint8:
            torch.clamp(frames, 0, 1, out=target)
        else:
            target.copy_(frames.clamp(0, 1).mul_(255).round_())
        return into

    # ------------------------------------------------------------------------------------------ helpers

    def _param(self, part: str) -> torch.Tensor:
        module = getattr(self, part)
        if module is None:
            verb = "encode" if part == "encoder" else "decode"
            raise RuntimeError(f"this TAEHV was loaded without its {part}, so it cannot {verb}")
        return next(module.parameters())

    def dispatch_table(self) -> str:
        """Which implementation each conv layer ran with (filled in as layers run)."""
        return dispatch.dispatch_table(self)

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, {self.arch.describe()}"


def _frames_kernel_takes(out: torch.Tensor, into: torch.Tensor, patch: int, skip: int = 0) -> bool:
    """Whether the output frames go through the Triton pass: on CUDA, outside torch.compile (which traces the PyTorch
    ops), where the kernel supports the call, once the dispatcher runs kernels in this process (the "kernels" backend,
    or a kernel row decided: in auto mode, before tuning has answered, the first calls compile and load nothing), and
    in a CUDA-graph capture only when this exact call was launched before (the capture's warm-up makes it)."""
    if not out.is_cuda or torch.compiler.is_compiling():
        return False
    mode = dispatch.get_backend()
    if mode == "torch" or (mode == "auto" and not dispatch.kernel_chosen()):
        return False
    from ...kernels import triton_frames

    if torch.cuda.is_current_stream_capturing() and not triton_frames.ready(out, into, patch, skip):
        return False
    return triton_frames.unsupported_reason(out, into, patch) is None


def _stride_product(strides, flags) -> int:
    """The product of the strides whose stage is switched on."""
    return math.prod(stride for stride, on in zip(strides, flags) if on)


def _flags(value, name: str) -> tuple:
    if value is None:
        return (True, True, True)
    flags = tuple(bool(v) for v in value)
    if len(flags) == 2:
        flags = (False if name == "time_upscale" else True,) + flags
    if len(flags) != 3:
        raise ValueError(f"{name} takes 3 flags (one per decoder stage) or 2 (the last two), got {value!r}")
    return flags


def _describe(signature: tuple) -> str:
    n, h, w, dtype, device, _ = signature
    return f"batch {n} at {h}x{w} ({str(dtype).replace('torch.', '')} on {device})"


def chunk_spans(total: int, most: int) -> list[tuple[int, int]]:
    """(start, stop) of the fewest chunks of at most `most` that cover range(total), their lengths within one of
    each other (no short last chunk: every chunk's convs get a similar batch)."""
    count = -(-total // most)
    bounds = [total * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _progress(items, show: bool, what: str):
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"TAEHV {what}", unit="step")
