"""TAESD: the tiny autoencoder, every published variant, with upstream state_dict keys."""

from __future__ import annotations

import os

import torch

from ... import dispatch
from ...graphs import GraphCache, parameters_of
from ...validation import as_float_dtype, check_device, check_multiple, check_tensor
from ...value_range import warn_if_unusual_range
from ..layers import TinyAutoencoder, preferred_layout
from . import hub
from .architecture import VARIANTS, Architecture, build_decoder, build_encoder


class TAESD(TinyAutoencoder):
    """Tiny AutoEncoder. Images are [B, 3, H, W] in [0, 1]; latents are unscaled (scale factor 1).

    `encoder` and `decoder` are bare nn.Sequentials whose state_dict keys are upstream's, so upstream
    `taesd_encoder.pth` / `taesd_decoder.safetensors` files load into them unchanged. Either may be None.

    cuda_graphs (default True): on CUDA, `encode` / `decode` replay a CUDA graph from the second call with the same
    input shape on (graphs.GraphCache). Eager calls are bound by kernel launches: decode 256² B=1 took 2.4 ms
    eagerly and 0.21 ms as a replay on an H200 (BENCHMARKS.md). Set it to False to always run eagerly.
    """

    latent_magnitude = 3.0
    latent_shift = 0.5

    def __init__(self, variant: str = "taesd", encoder: bool = True, decoder: bool = True):
        hub.known_variant(variant)
        arch: Architecture = VARIANTS[variant]
        super().__init__(arch, variant, build_encoder(arch) if encoder else None,
                         build_decoder(arch) if decoder else None,
                         graph_caches={"encoder": GraphCache(), "decoder": GraphCache(), "raw_decoder": GraphCache()})

    @property
    def downscale(self) -> int:
        """Pixels per latent along each side: 8, or 32 for taesana."""
        return self.arch.downscale

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike | None = None,
        *,
        encoder_path: str | os.PathLike | None = None,
        decoder_path: str | os.PathLike | None = None,
        variant: str | None = None,
        encoder: bool = True,
        decoder: bool = True,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        subfolder: str | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> "TAESD":
        """Load pretrained weights.

        name_or_path: a Hub repo id ("madebyollin/taesd", "madebyollin/taesdxl", ...), a local folder holding
            upstream or diffusers-layout files, or None for the bundled TAEF2 weights (works offline).
        encoder_path / decoder_path: explicit upstream files instead (.safetensors or .pth); give one for an
            encoder-only or decoder-only model.
        variant: which variant's files to take from a folder or repo holding several; the variant is also
            detected from the tensors, and a name that disagrees with them is an error.
        Returns the model in eval mode with requires_grad off (call `.requires_grad_()` to train it).
        """
        dtype = as_float_dtype(dtype)
        loaded = hub.resolve(
            name_or_path, encoder_path=encoder_path, decoder_path=decoder_path, load_encoder=encoder,
            load_decoder=decoder, variant=variant, revision=revision, cache_dir=cache_dir,
            local_files_only=local_files_only, subfolder=subfolder,
        )
        return cls.from_loaded(loaded, variant=variant, dtype=dtype, device=device)

    @classmethod
    def from_loaded(cls, loaded: "hub.LoadedWeights", *, variant: str | None = None,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "TAESD":
        """The model for state dicts already read (hub.resolve, or converted from another library's module)."""
        dtype = as_float_dtype(dtype)
        device = check_device(device)  # a clear error for CUDA on a CPU-only torch, before any work
        dispatch.prepare(device)  # kernel modules import in the background while the model loads
        arch = hub.detect_architecture(loaded)
        name = hub.check_variant(arch, variant, loaded)
        model = cls(name, encoder=loaded.encoder is not None, decoder=loaded.decoder is not None)
        model.load_weights(loaded.encoder, loaded.decoder, source=", ".join(loaded.sources))
        # An inference model: eval mode and no gradients for the weights, so a call made without torch.no_grad()
        # records no autograd graph and can run our kernels and graph replays (model.requires_grad_() to train).
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def load_weights(self, encoder_state=None, decoder_state=None, source: str = "state dict") -> None:
        """Load upstream-keyed state dicts, with a clear error when they belong to another variant."""
        for part, state in (("encoder", encoder_state), ("decoder", decoder_state)):
            if state is None:
                continue
            module = getattr(self, part)
            if module is None:
                raise ValueError(f"this TAESD was built without a {part}; cannot load {part} weights")
            hub.check_fits(self.arch, part, state, source)
            module.load_state_dict(state)

    preferred_layout = staticmethod(preferred_layout)  # x in the layout the model runs fastest with on its device

    def _param(self, part: str) -> torch.Tensor:
        module = getattr(self, part)
        if module is None:
            other = "decoder" if part == "encoder" else "encoder"
            verb = "encode" if part == "encoder" else "decode"
            raise RuntimeError(f"this TAESD model has no {part} (it was loaded {other}-only), so it cannot {verb}")
        return next(module.parameters())

    def encode(self, images: torch.Tensor, tile_size: int | str | None = None, *,
               overlap: int | None = None, progress: bool = False) -> torch.Tensor:
        """[B, 3, H, W] images in [0, 1] -> [B, C, H/8, W/8] latents (H/32, W/32 for taesana).

        H and W must be multiples of the downscale factor; pad or resize first (no silent padding). Images far
        outside [0, 1] (0-255 values, or [-1, 1]) get a warning naming the likely cause (taesd_fast.value_range).
        tile_size: encode in tiles of this many image pixels per side to bound memory (a multiple of 8; 32 for
            taesana), or "auto": the largest tile that fits in the free memory, and no tiling when the whole image
            fits. The result equals the untiled encode (tiling.py). A tile below the efficient minimum
            (twice the overlap: 144 px for TAEF2, 304 px for taesd) is raised to it with a warning.
        overlap: image pixels added around each tile; default: the receptive field, which makes tiling exact.
        progress: show a tqdm bar over the layers run (tile by tile) when the call takes more than 2 s
            (progress.py): for large images on a CPU, which take minutes.
        """
        return self._encode(images, tile_size, overlap, progress=progress)

    def decode(self, latents: torch.Tensor, tile_size: int | str | None = None, *,
               overlap: int | None = None, progress: bool = False) -> torch.Tensor:
        """[B, C, h, w] latents -> [B, 3, h*8, w*8] images clamped to [0, 1]. NaN in the latents stays NaN.

        tile_size, overlap: decode in tiles of this many output (image) pixels, as in `encode`; "auto" fits the
            free memory. The result equals the untiled decode (tiling.py).
        progress: a progress bar for long calls, as in `encode`.
        """
        return self._decode(latents, tile_size, overlap, progress=progress)

    def decode_unclamped(self, latents: torch.Tensor) -> torch.Tensor:
        """`decode` without the final clamp to [0, 1]: what diffusers' DecoderTiny returns."""
        return self._decode(latents, None, None, clamp=False)

    def _encode(self, images: torch.Tensor, tile_size, overlap, *,
                value_range: tuple[float, float] | None = (0.0, 1.0), progress: bool = False) -> torch.Tensor:
        """encode; value_range is the range the caller's images should lie in, None when the caller checked it (the
        diffusers adapter)."""
        param = self._param("encoder")
        check_tensor(images, "images", channels=3, like=param)
        check_multiple(images, self.downscale, f"the {self.variant} encoder downsamples {self.downscale}x")
        if value_range is not None:
            warn_if_unusual_range(images, value_range, self._range_checked)
        images = self.preferred_layout(images)
        tile, overlap = self._tiling("encoder", images, tile_size, overlap)
        with self._progress("encoder", images, tile, overlap, progress):
            if tile is None:
                return self._run("encoder", self.encoder, images)
            from .tiling import run_tiled

            return run_tiled(self, "encoder", images, tile, overlap)

    def _decode(self, latents: torch.Tensor, tile_size, overlap, *, clamp: bool = True,
                progress: bool = False) -> torch.Tensor:
        param = self._param("decoder")
        check_tensor(latents, "latents", channels=self.latent_channels, like=param)
        latents = self.preferred_layout(latents)
        tile, overlap = self._tiling("decoder", latents, tile_size, overlap)
        with self._progress("decoder", latents, tile, overlap, progress):
            if tile is None:
                if clamp:
                    return self._run("decoder", lambda z: self.decoder(z).clamp(0, 1), latents)
                return self._run("raw_decoder", self.decoder, latents)
            from .tiling import run_tiled

            out = run_tiled(self, "decoder", latents, tile, overlap)
        return out.clamp_(0, 1) if clamp else out

    def _progress(self, part: str, x: torch.Tensor, tile: int | None, overlap: int, enabled: bool):
        """The progress bar of one encode / decode call (progress.py), or a no-op when not `enabled`."""
        from contextlib import nullcontext

        if not enabled:
            return nullcontext()
        from .progress import layer_calls, layer_progress

        calls, windows = layer_calls(self, part, x, tile, overlap)
        desc = ("encode" if part == "encoder" else "decode") + (f" ({windows} tiles)" if windows > 1 else "")
        return layer_progress(getattr(self, part), calls, desc)

    def _tiling(self, part: str, x: torch.Tensor, tile_size, overlap) -> tuple[int | None, int]:
        """(tile in image pixels or None for untiled, overlap in image pixels) for this call."""
        if tile_size is None:
            if overlap is not None:
                raise ValueError(f"overlap={overlap!r} was given without tile_size; pass tile_size (pixels or 'auto') too")
            return None, 0
        from . import tiling

        tiling.check_tile_arguments(self, tile_size, overlap)
        overlap = tiling.overlap_pixels(self, part) if overlap is None else overlap
        return tiling.choose_tile(self, part, x, tile_size, overlap), overlap

    def _run(self, cache: str, fn, x: torch.Tensor) -> torch.Tensor:
        part = self.encoder if cache == "encoder" else self.decoder
        if not self.cuda_graphs:
            return fn(x)
        return self._graph_caches[cache](fn, x, parameters_of(part))

    @staticmethod
    def scale_latents(latents: torch.Tensor) -> torch.Tensor:
        """Raw latents -> [0, 1], for storing as 8-bit images."""
        return latents.div(2 * TAESD.latent_magnitude).add(TAESD.latent_shift).clamp(0, 1)

    @staticmethod
    def unscale_latents(scaled: torch.Tensor) -> torch.Tensor:
        """[0, 1] -> raw latents (the inverse of `scale_latents` inside the clamp range)."""
        return scaled.sub(TAESD.latent_shift).mul(2 * TAESD.latent_magnitude)

    def warmup(self, shapes, part: str = "decoder") -> str:
        """Tune ahead of deployment: run `part` ("decoder", "encoder" or "both") on random inputs of each shape with
        blocking tuning, twice per shape (the first call makes the eager decisions, the second captures the CUDA
        graph that later calls replay, deciding for replays), so no later call of these shapes runs PyTorch while
        kernels are timed. Timings are stored in the cache dir for later processes. Returns the dispatch table.

        shapes: (B, H, W) image sizes in pixels, or, for one part, that part's full input shape (B, C, h, w):
            latents for the decoder, images for the encoder. Example: `model.warmup([(1, 256, 256), (64, 256, 256)])`.
        """
        from ... import dispatch

        parts = {"decoder": ("decoder",), "encoder": ("encoder",), "both": ("encoder", "decoder")}.get(part)
        if parts is None:
            raise ValueError(f"part must be 'decoder', 'encoder' or 'both', got {part!r}")
        for shape in shapes:
            shape = tuple(int(n) for n in shape)
            if len(shape) not in (3, 4) or (len(shape) == 4 and len(parts) > 1):
                raise ValueError(f"warmup shape {shape}: expected (B, H, W) in pixels"
                                 + (", or the part's input shape (B, C, h, w)" if len(parts) == 1 else ""))
            for name in parts:
                param = self._param(name)
                if len(shape) == 4:
                    inputs = shape
                elif name == "decoder":
                    inputs = (shape[0], self.latent_channels, shape[1] // self.downscale, shape[2] // self.downscale)
                else:
                    inputs = (shape[0], 3, shape[1], shape[2])
                gen = torch.Generator(param.device).manual_seed(0)  # the caller's RNG stays untouched
                x = torch.rand(inputs, generator=gen, device=param.device, dtype=param.dtype)
                call = self.encode if name == "encoder" else self.decode
                with dispatch.tuning("blocking"), torch.no_grad():
                    call(x)
                    call(x)
        return self.dispatch_table()

    def dispatch_table(self) -> str:
        """Which implementation each conv layer ran with (filled in as layers run)."""
        from ... import dispatch

        return dispatch.dispatch_table(self)

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, {self.arch.describe()}"
