"""taesd_fast: TAESD, TAEHV and the Wan 2.2 VAE output head, with custom GPU kernels behind measured dispatch.

Importing this package never initialises CUDA or compiles anything; kernels are built on first use.
"""

from ._backend import kernels_available, kernels_unavailable_reason
from .models.taesd.diffusers import AutoencoderTinyFast
from .dispatch import backend, set_backend, set_tuning, tuning
from .graphs import CUDAGraphed
from .models.head.model import OutputHead
from .models.taesd.model import TAESD
from .models.taehv.model import TAEHV
from .models.taesd.tiling import decode_tiled, encode_tiled

__all__ = [
    "TAESD", "TAEHV", "OutputHead", "AutoencoderTinyFast", "CUDAGraphed", "decode_tiled", "encode_tiled",
    "backend", "set_backend", "tuning", "set_tuning", "kernels_available", "kernels_unavailable_reason",
]
__version__ = "0.1.0"
