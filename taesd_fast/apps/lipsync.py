"""Lip-sync decode: decode a lip-sync generator's face latents with TAESD and paste the faces back into the video.

A lip-sync generator (MuseTalk-style) predicts VAE latents for a square crop of the face in every frame. This module
does the rest: read the frames (PyAV), crop the face box and resize it to size², decode the latents in batches,
resize each face back and blend it into its frame through a feathered mask over the lower half of the face, and
write an H.264 mp4 with the source's fps, size and audio. With no latents, the crops are encoded first (a round
trip), so the whole pipeline runs with the bundled offline weights.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from itertools import islice
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.taesd.model import TAESD
from .facebox import SUN_FACE_BOX, Box  # noqa: F401  (re-exported: part of this module's API)
from .output_files import atomic_write, check_outputs

X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
CROP_SIZE = 256  # lip-sync generators (MuseTalk) work on 256² face crops
FEATHER = 0.15  # mask fade width, as a fraction of the box's width/height


# ------------------------------------------------------------------------------------------------------ video I/O


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    fps: Fraction
    frames: int  # 0 when the container does not say
    has_audio: bool


@contextmanager
def _reading_video(path: str | os.PathLike):
    """PyAV's errors (errno text such as "[Errno 1094995529] Invalid data found ...") -> one ValueError that names
    the file and FFmpeg's reason."""
    try:
        yield
    except av.error.FFmpegError as err:
        raise ValueError(f"cannot read video {path}: {err.strerror or err} (not a video file, or truncated or "
                         "damaged)") from err


def probe(path: str | os.PathLike) -> VideoInfo:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video not found: {path}")
    with _reading_video(path), av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream")
        stream = container.streams.video[0]
        if not (stream.width and stream.height):  # e.g. a text file named .png, which FFmpeg's image reader accepts
            raise ValueError(f"{path} is not a video: FFmpeg reads it as {container.format.name!r} with no frame size "
                             "(expected a video file, such as an .mp4)")
        fps = stream.average_rate or stream.guessed_rate
        if not fps:
            raise ValueError(f"{path}: cannot tell the frame rate of its video stream")
        return VideoInfo(stream.width, stream.height, Fraction(fps), stream.frames or 0, bool(container.streams.audio))


def read_frames(path: str | os.PathLike, max_frames: int | None = None) -> Iterator[np.ndarray]:
    """The video's frames as [H, W, 3] uint8 RGB arrays, one at a time (a whole video would not fit in memory)."""
    with _reading_video(path), av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame-parallel decoding
        for frame in islice(container.decode(stream), max_frames):
            yield frame.to_ndarray(format="rgb24")


class VideoWriter:
    """H.264 (yuv420p) writer at a constant frame rate (a variable-rate source comes out at its average rate);
    copies `audio_source`'s first audio stream on close.

    The audio is trimmed to the written video's length. It is copied as is where the output container can hold
    its codec, else re-encoded to AAC. H.264 with 4:2:0 chroma needs an even frame size: an odd width or height is
    padded by repeating the last column or row (the stream is then one pixel larger; libx264 offers no way to
    crop it back in the stream), with a warning.
    """

    def __init__(self, path: str | os.PathLike, fps: Fraction, width: int, height: int, *, crf: int = 18,
                 preset: str = "veryfast", audio_source: str | os.PathLike | None = None):
        if preset not in X264_PRESETS:
            raise ValueError(f"unknown x264 preset {preset!r}; expected one of {', '.join(X264_PRESETS)}")
        if not 0 <= crf <= 51:
            raise ValueError(f"crf must be between 0 (lossless) and 51, got {crf}")
        self.width, self.height = width, height
        self.pad = (height % 2, width % 2)  # rows and columns added to reach an even size
        if any(self.pad):
            warnings.warn(f"H.264 needs an even frame size: the {width}x{height} frames are written as "
                          f"{width + self.pad[1]}x{height + self.pad[0]}, the last column/row repeated",
                          stacklevel=2)
        self.fps = Fraction(fps)
        self.frames = 0
        self.container = av.open(str(path), mode="w")
        try:
            # veryfast: 2.5x the speed of x264's default preset, at the same crf and a similar file size here
            self.stream = self.container.add_stream("libx264", rate=self.fps,
                                                    options={"crf": str(crf), "preset": preset})
            self.stream.width, self.stream.height = width + self.pad[1], height + self.pad[0]
            self.stream.pix_fmt = "yuv420p"
            self.stream.codec_context.time_base = 1 / self.fps
            # Every stream must exist before the first packet is written, so the audio stream is added now.
            self._audio_input = self._audio_stream = None
            self._copy_audio_packets = False
            if audio_source is not None:
                self._add_audio(audio_source)
        except BaseException:
            self.container.close()
            raise

    def _add_audio(self, source) -> None:
        source = av.open(str(source))
        if not source.streams.audio:
            source.close()
            return
        self._audio_input = source
        template = source.streams.audio[0]
        self._copy_audio_packets = template.codec_context.name in self.container.supported_codecs
        if self._copy_audio_packets:
            self._audio_stream = self.container.add_stream_from_template(template)
        else:
            self._audio_stream = self.container.add_stream("aac", rate=template.codec_context.sample_rate)

    def write(self, frame: np.ndarray) -> None:
        """frame: [H, W, 3] uint8 RGB, of the size given to the constructor."""
        if frame.shape[:2] != (self.height, self.width):
            raise ValueError(f"frame is {frame.shape[1]}x{frame.shape[0]}, but the video is {self.width}x{self.height}")
        if any(self.pad):
            frame = np.pad(frame, ((0, self.pad[0]), (0, self.pad[1]), (0, 0)), mode="edge")
        video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
        video_frame.pts = self.frames
        video_frame.time_base = self.stream.codec_context.time_base
        self.frames += 1
        self.container.mux(self.stream.encode(video_frame))

    def write_batch(self, frames: np.ndarray) -> int:
        """frames: [B, H, W, 3] uint8 RGB. Returns B."""
        for frame in frames:
            self.write(frame)
        return len(frames)

    def close(self) -> None:
        try:
            self.container.mux(self.stream.encode(None))  # flush the encoder's delayed frames
            if self._audio_input is not None:
                self._copy_audio(duration=self.frames / self.fps)
        finally:
            if self._audio_input is not None:
                self._audio_input.close()
            self.container.close()

    def _copy_audio(self, duration: Fraction) -> None:
        source = self._audio_input.streams.audio[0]
        out = self._audio_stream
        if self._copy_audio_packets:
            for packet in self._audio_input.demux(source):
                if packet.dts is None:  # the demuxer's empty end-of-stream packet
                    continue
                if packet.pts is not None and packet.pts * packet.time_base >= duration:
                    break
                packet.stream = out
                self.container.mux(packet)
            return
        for frame in self._audio_input.decode(source):
            if frame.time is not None and frame.time >= duration:
                break
            frame.pts = None  # let the encoder number the samples from zero
            self.container.mux(out.encode(frame))
        self.container.mux(out.encode(None))

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- crop, mask, paste


def crop_faces(regions: torch.Tensor, size: int = CROP_SIZE) -> torch.Tensor:
    """regions: [B, h, w, 3] uint8 face boxes -> [B, 3, size, size] float32 in [0, 1]."""
    faces = regions.permute(0, 3, 1, 2).float().div(255)
    # antialias: boxes larger than `size` are shrunk without aliasing
    return F.interpolate(faces, size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)


def lower_face_mask(height: int, width: int, feather: float = FEATHER, device=None) -> torch.Tensor:
    """[1, 1, height, width] blend weights for a face box: 0 on the upper half, 1 inside the lower half, fading to
    0 over `feather` of the box size towards every edge of the lower half, so no seam shows where it meets the frame.

    The lower half is what a lip-sync generator changes (mouth and jaw); the eyes and the box border stay original.
    """

    def ramp(n: int, start: int) -> torch.Tensor:
        # 1D weights: 0 before `start`, then a smoothstep rise and fall over `fade` pixels at both ends of [start, n)
        fade = max(1.0, feather * n)
        i = torch.arange(n, dtype=torch.float32, device=device)
        t = torch.minimum(i - start + 0.5, n - i - 0.5).div(fade).clamp(0, 1)
        return t * t * (3 - 2 * t)

    rows = ramp(height, height // 2)
    cols = ramp(width, 0)
    return (rows[:, None] * cols[None, :]).view(1, 1, height, width)


def blend_faces(regions: torch.Tensor, faces: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Paste faces into the face boxes.

    regions: [B, h, w, 3] uint8 original boxes; faces: [B, 3, s, s] in [0, 1]; mask: [1, 1, h, w].
    Returns [B, h, w, 3] uint8. Where the mask is 0 the original pixels come back bit-exact.
    """
    height, width = regions.shape[1:3]
    faces = F.interpolate(faces.float(), size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    original = regions.permute(0, 3, 1, 2).float()
    blended = torch.lerp(original, faces.clamp(0, 1) * 255, mask)
    return blended.round().to(torch.uint8).permute(0, 2, 3, 1)


# ------------------------------------------------------------------------------------------------ the pipeline


@dataclass
class LipsyncStats:
    frames: int
    decode_seconds: float  # model time only
    encode_seconds: float  # round-trip mode only: encoding the crops
    total_seconds: float  # the frame loop end to end: read, crop, model, paste, write
    setup_seconds: float = 0.0  # before the loop: loading latents, the GPU warm-up (kernel builds, conv tuning)

    @property
    def decode_fps(self) -> float:
        return self.frames / self.decode_seconds if self.decode_seconds else float("nan")

    @property
    def end_to_end_fps(self) -> float:
        return self.frames / self.total_seconds if self.total_seconds else float("nan")

    def summary(self) -> str:
        lines = [f"frames: {self.frames}", f"decode: {self.decode_fps:.1f} fps ({self.decode_seconds:.3f} s, model only)"]
        if self.encode_seconds:
            lines.append(f"encode (round trip): {self.frames / self.encode_seconds:.1f} fps ({self.encode_seconds:.3f} s)")
        lines.append(f"end to end: {self.end_to_end_fps:.1f} fps ({self.total_seconds:.3f} s: read, crop, model, "
                     f"paste, write; plus {self.setup_seconds:.1f} s of setup)")
        return "\n".join(lines)


def check_latents(latents: torch.Tensor, model: TAESD, size: int, info: VideoInfo, max_frames: int | None) -> None:
    """Fail before any work when the latents cannot belong to this model, crop size and video."""
    if latents.dim() != 4:
        raise ValueError(f"latents must be [N, C, h, w] (one per frame), got shape {tuple(latents.shape)}")
    n, channels, h, w = latents.shape
    if channels != model.latent_channels:
        raise ValueError(
            f"latents have {channels} channels but the {model.variant} model expects {model.latent_channels}; "
            "load the weights of the VAE the latents were made for (--weights)"
        )
    side = size // model.downscale
    if (h, w) != (side, side):
        raise ValueError(f"latents are {h}x{w} but {size}² face crops need {side}x{side} latents "
                         f"({model.variant} downscales {model.downscale}x)")
    if info.frames:
        wanted = min(info.frames, max_frames) if max_frames else info.frames
        if n < wanted or n > info.frames:
            raise ValueError(f"latents hold {n} frames but the video has {info.frames}"
                             + (f" (using the first {wanted}: --max-frames)" if wanted < info.frames else "")
                             + "; need one latent per frame")


def batched(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: time it only once it has finished


@contextmanager
def _timed(device: torch.device, seconds: dict, key: str):
    _synchronize(device)
    tick = time.perf_counter()
    yield
    _synchronize(device)
    seconds[key] += time.perf_counter() - tick


def _warm_up(model: TAESD, batch_sizes: set[int], size: int, encode: bool) -> None:
    """Untimed model calls at every batch size the loop will use, so the decode fps leaves out one-off costs:
    kernel builds, the dispatcher timing each new conv shape, cuDNN's algorithm search, and the CUDA-graph capture
    that TAESD makes on the second call of a shape. Only worth it on a GPU."""
    param = next(model.parameters())
    side = size // model.downscale
    gen = torch.Generator(param.device).manual_seed(0)  # the caller's RNG stays untouched
    with torch.inference_mode():
        for n in [n for n in sorted(batch_sizes) for _ in range(2)]:
            if encode:
                model.encode(torch.rand(n, 3, size, size, generator=gen, device=param.device, dtype=param.dtype))
            model.decode(torch.randn(n, model.latent_channels, side, side, generator=gen, device=param.device,
                                     dtype=param.dtype))
    _synchronize(param.device)


def _load_and_check(model: TAESD, latents, size: int, info: VideoInfo, max_frames: int | None):
    if isinstance(latents, (str, os.PathLike)):
        from .latents_io import load_latents

        path = latents
        latents, record = load_latents(path)
        if record is not None:
            record.check_model(model, path)
    if latents is not None:
        check_latents(latents, model, size, info, max_frames)
    elif model.encoder is None:
        raise ValueError("no latents were given, so the face crops must be encoded first, but the model has no encoder")
    return latents


def lipsync_video(
    video: str | os.PathLike,
    output: str | os.PathLike,
    model: TAESD,
    *,
    box: Box,
    latents: torch.Tensor | str | os.PathLike | None = None,
    batch_size: int = 8,
    max_frames: int | None = None,
    size: int = CROP_SIZE,
    feather: float = FEATHER,
    crf: int = 18,
    preset: str = "veryfast",
    progress: bool = True,
) -> LipsyncStats:
    """Decode `latents` ([N, C, size/8, size/8], one per frame) into the face box of `video`, writing `output`.

    latents: a tensor or a latents file (see `latents_io.load_latents`); None encodes the face crops first
    and decodes them again (round trip). Runs on the model's device and dtype. crf/preset: libx264's quality and
    speed. Returns the frame count and timings.
    """
    setup_start = time.perf_counter()
    video, output = Path(video), Path(output)
    info = probe(video)
    box.check_inside(info.width, info.height)
    if batch_size < 1 or (max_frames is not None and max_frames < 1):
        raise ValueError(f"batch size and max frames must be at least 1, got {batch_size} and {max_frames}")
    if size % model.downscale:
        raise ValueError(f"crop size {size} is not a multiple of the model's downscale factor {model.downscale}")
    # Never over an input; an existing output is replaced (the CLI asks for --overwrite first).
    check_outputs([video, latents if isinstance(latents, (str, os.PathLike)) else None], [output], overwrite=True)
    latents = _load_and_check(model, latents, size, info, max_frames)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    total = min(n for n in (info.frames, max_frames) if n) if (info.frames or max_frames) else None
    if device.type == "cuda":
        _warm_up(model, {min(batch_size, total or batch_size), (total or 0) % batch_size} - {0}, size,
                 encode=latents is None)
    mask = lower_face_mask(box.height, box.width, feather, device=device)
    seconds = {"encode": 0.0, "decode": 0.0}
    done = 0
    start = time.perf_counter()
    with atomic_write(output) as partial:  # a failure leaves no partial video, and any earlier output intact
        with VideoWriter(partial, info.fps, info.width, info.height, crf=crf, preset=preset,
                         audio_source=video if info.has_audio else None) as writer, \
                ThreadPoolExecutor(max_workers=1) as background, \
                tqdm(total=total, unit="frame", desc="lipsync", disable=not progress) as bar:
            writing = None
            for batch in batched(read_frames(video, max_frames), batch_size):
                frames = np.stack(batch)  # [B, H, W, 3] uint8
                regions = torch.from_numpy(frames[:, box.y0:box.y1, box.x0:box.x1]).to(device)  # only the boxes move
                with torch.inference_mode():
                    if latents is None:
                        with _timed(device, seconds, "encode"):
                            batch_latents = model.encode(crop_faces(regions, size).to(dtype))
                    elif done + len(batch) > len(latents):
                        raise ValueError(f"latents hold {len(latents)} frames but the video has more; "
                                         "need one latent per frame (or pass --max-frames)")
                    else:
                        batch_latents = latents[done:done + len(batch)].to(device=device, dtype=dtype)
                    with _timed(device, seconds, "decode"):
                        faces = model.decode(batch_latents)
                    frames[:, box.y0:box.y1, box.x0:box.x1] = blend_faces(regions, faces, mask).cpu().numpy()
                # H.264 encoding is the slowest step: it runs in the background, overlapping the next batch.
                if writing is not None:
                    bar.update(writing.result())
                writing = background.submit(writer.write_batch, frames)
                done += len(batch)
            if writing is not None:
                bar.update(writing.result())
        if latents is not None and max_frames is None and done != len(latents):
            raise ValueError(f"latents hold {len(latents)} frames but the video has {done}; need one latent per frame")
        if done == 0:
            raise ValueError(f"{video} has no frames to decode")
    end = time.perf_counter()
    return LipsyncStats(done, seconds["decode"], seconds["encode"], end - start, start - setup_start)
