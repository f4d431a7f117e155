"""An independent, deliberately plain float64 implementation of the published TAESD architectures.

Written from the architecture description, not from taesd_fast (nothing here imports the package): it takes a
state dict with upstream keys (bare nn.Sequential indices such as ``3.conv.0.weight``) and evaluates it with
``torch.nn.functional`` calls in float64. Tests compare taesd_fast against it.

Layer layouts (index -> layer) are written out below from the description; the state dict must agree with them
(a conv index must carry a weight, a parameterless index must carry none, a Block must carry ``conv.*``), and
everything else -- channel counts, biases, 1x1 skips, TAEF2's pool branch -- is read from the keys. Every key of the
state dict must be used, so a weights file that does not fit the layout is an error, not a silent partial load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Layer kinds: "conv" (3x3, stride 1, padding 1), "conv_s2" (3x3, stride 2, padding 1), "block", "relu",
# "upsample" (nearest, x2), "clamp" (tanh(x / 3) * 3).
_F8_ENCODER = ["conv", "block"] + 3 * (["conv_s2"] + 3 * ["block"]) + ["conv"]
_F32_ENCODER = ["conv_s2", "relu", "conv_s2", "relu", "block"] + 3 * (["conv_s2"] + 3 * ["block"]) + ["conv"]
_F8_DECODER = (
    ["clamp", "conv", "relu"]
    + 3 * (3 * ["block"] + ["upsample", "conv"])
    + ["block", "conv"]
)
LAYOUTS = {"f8_encoder": _F8_ENCODER, "f32_encoder": _F32_ENCODER, "f8_decoder": _F8_DECODER}

GROUPNORM_GROUPS = 4
GROUPNORM_EPS = 1e-5


def _prefixed(state: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    prefix = f"{index}."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def guess_encoder_layout(state: dict[str, torch.Tensor]) -> str:
    """'f32_encoder' when index 1 holds no tensors (a parameterless ReLU after a stride-2 stem conv)."""
    return "f32_encoder" if not _prefixed(state, 1) else "f8_encoder"


class ReferenceTAESDPart:
    """One encoder or decoder, evaluated layer by layer in float64."""

    def __init__(self, state: dict[str, torch.Tensor], layout: str):
        self.layout = LAYOUTS[layout]
        self.params = {k: v.detach().to("cpu", torch.float64) for k, v in state.items()}
        used: set[str] = set()
        self.layers = []
        for index, kind in enumerate(self.layout):
            own = _prefixed(self.params, index)
            used.update(f"{index}.{k}" for k in own)
            if kind in ("conv", "conv_s2"):
                if set(own) - {"weight", "bias"} or "weight" not in own or own["weight"].shape[-2:] != (3, 3):
                    raise ValueError(f"index {index} should be a 3x3 conv, keys {sorted(own)}")
            elif kind == "block":
                if "conv.0.weight" not in own:
                    raise ValueError(f"index {index} should be a Block, keys {sorted(own)}")
            elif own:
                raise ValueError(f"index {index} should be a parameterless {kind}, has keys {sorted(own)}")
            self.layers.append((kind, own))
        unused = sorted(set(self.params) - used)
        if unused:
            raise ValueError(f"state dict keys not used by the {layout} layout: {unused[:5]}")

    @staticmethod
    def _block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        if "pool.0.weight" in p:
            # TAEF2 pool branch, added to the input before the block body (and before the skip).
            g = F.conv2d(x, p["pool.0.weight"])
            g = F.group_norm(g, GROUPNORM_GROUPS, p["pool.1.weight"], p["pool.1.bias"], eps=GROUPNORM_EPS)
            x = x + F.conv2d(F.relu(g), p["pool.3.weight"])
        h = F.relu(F.conv2d(x, p["conv.0.weight"], p.get("conv.0.bias"), padding=1))
        h = F.relu(F.conv2d(h, p["conv.2.weight"], p.get("conv.2.bias"), padding=1))
        h = F.conv2d(h, p["conv.4.weight"], p.get("conv.4.bias"), padding=1)
        skip = F.conv2d(x, p["skip.weight"]) if "skip.weight" in p else x
        return F.relu(h + skip)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to("cpu", torch.float64)  # no detach: tests may differentiate through the reference
        for kind, p in self.layers:
            if kind == "conv":
                x = F.conv2d(x, p["weight"], p.get("bias"), stride=1, padding=1)
            elif kind == "conv_s2":
                x = F.conv2d(x, p["weight"], p.get("bias"), stride=2, padding=1)
            elif kind == "block":
                x = self._block(x, p)
            elif kind == "relu":
                x = F.relu(x)
            elif kind == "upsample":
                x = F.interpolate(x, scale_factor=2, mode="nearest")
            elif kind == "clamp":
                x = torch.tanh(x / 3) * 3
            else:  # pragma: no cover - the layouts above only use the kinds handled here
                raise AssertionError(kind)
        return x


def reference_encoder(state: dict[str, torch.Tensor]) -> ReferenceTAESDPart:
    return ReferenceTAESDPart(state, guess_encoder_layout(state))


def reference_decoder(state: dict[str, torch.Tensor]) -> ReferenceTAESDPart:
    return ReferenceTAESDPart(state, "f8_decoder")
