"""The fused tail kernel's packed weights (kernels/cuda_tail.py), checked on the CPU: the kernel's indexing, written
out in PyTorch (phase (py, px) tap (ty, tx), block ((py * 2 + ty) * 2 + tx) * 2 + px of the folded weight, read at
low-res row ceil(Y / 2) - 1 + ty, column x + px - 1 + tx; the projection's row ky * 9 + kx * 3 + c and its tap
sums), reproduces TGrow + upsample + conv + ReLU + the last conv of a float64 reference to f16 weight rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast.kernels import cuda_tail


def _reference(x, gw, w, b, w2, b2):
    n, c, h, wd = x.shape
    g = gw.shape[0] // c
    grown = F.conv2d(x, gw).view(n, g, c, h, wd).reshape(n * g, c, h, wd)
    hid = F.relu(F.conv2d(F.interpolate(grown, scale_factor=2, mode="nearest"), w, b, padding=1))
    return F.conv2d(hid, w2, b2, padding=1)


def _projected(hid, wp, b2):
    """The kernel's last conv: P = h x the [32, 64] projection, then output (r, x, c) = bias + the sum over (ky, kx)
    of P[r + ky - 1][x + kx - 1][ky * 9 + kx * 3 + c] (zero outside h)."""
    n, _, h, w = hid.shape
    p = torch.einsum("nihw,ki->nkhw", F.pad(hid, (1, 1, 1, 1)), wp.double())  # [n, 32, h + 2, w + 2]
    out = b2.view(1, 3, 1, 1).expand(n, 3, h, w).clone()
    for ky in range(3):
        for kx in range(3):
            out += p[:, ky * 9 + kx * 3:ky * 9 + kx * 3 + 3, ky:ky + h, kx:kx + w]
    return out


def _emulated(x, w1p, b, w2p, b2, g):
    """The kernel's arithmetic in float64 from the packed f16 weights."""
    n, c, h, wd = x.shape
    blocks = w1p.double().view(g, 16, c, c)  # [group, block, c_out, c_in]
    xp = F.pad(x, (1, 1, 1, 1))  # low-res zero padding: index + 1
    hid = torch.zeros(n * g, c, 2 * h, 2 * wd, dtype=torch.float64)
    for f in range(n * g):
        for py in range(2):
            for px in range(2):
                acc = torch.zeros(c, h, wd, dtype=torch.float64)
                for ty in range(2):
                    for tx in range(2):
                        blk = blocks[f % g, ((py * 2 + ty) * 2 + tx) * 2 + px]
                        # output (2y + py, 2x + px) reads low-res (y + py - 1 + ty, x + px - 1 + tx)
                        patch = xp[f // g, :, py + ty:py + ty + h, px + tx:px + tx + wd]
                        acc += torch.einsum("oi,ihw->ohw", blk, patch)
                hid[f, :, py::2, px::2] = acc
    return _projected(F.relu(hid + b.view(1, -1, 1, 1)), w2p, b2)


@pytest.mark.parametrize("groups", [1, 2])
def test_packed_weights_follow_the_kernels_indexing(groups):
    gen = torch.Generator().manual_seed(groups)
    c = 64
    x = torch.randn(2, c, 5, 7, generator=gen, dtype=torch.float64)
    gw = torch.randn(groups * c, c, 1, 1, generator=gen, dtype=torch.float64) / c**0.5
    w = torch.randn(c, c, 3, 3, generator=gen, dtype=torch.float64) / (3 * c**0.5)
    b = torch.randn(c, generator=gen, dtype=torch.float64) * 0.3
    w2 = torch.randn(3, c, 3, 3, generator=gen, dtype=torch.float64) / (3 * c**0.5)
    b2 = torch.randn(3, generator=gen, dtype=torch.float64) * 0.3
    w1p = cuda_tail.folded_weight(w.float(), gw.float())
    w2p = cuda_tail.projected_weight(w2.float())
    assert w1p.shape == (groups * 16 * c, c) and w1p.dtype == torch.float16
    ref = _reference(x, gw, w, b, w2, b2)
    got = _emulated(x, w1p, b, w2p, b2, groups)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-3, f"rel err {err:.3g}: the packed weights do not follow the kernel's indexing"
    # And a wrong block order is caught: swapping the column phases breaks it.
    swapped = w1p.view(groups, 8, 2, c, c).flip(2).reshape_as(w1p)
    assert ((_emulated(x, swapped, b, w2p, b2, groups) - ref).norm() / ref.norm()).item() > 0.1


def test_projected_weight_follows_the_kernels_tap_sums():
    """The projection, row ky * 9 + kx * 3 + c = the last conv's [c, :, ky, kx], rows 27-31 zero, summed over the
    taps as the kernel does, reproduces the last conv; a transposed tap order does not."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 64, 6, 9, generator=gen, dtype=torch.float64)
    w2 = torch.randn(3, 64, 3, 3, generator=gen, dtype=torch.float64) / 24
    b2 = torch.randn(3, generator=gen, dtype=torch.float64)
    wp = cuda_tail.projected_weight(w2.float())
    assert wp.shape == (32, 64) and not wp[27:].any()
    ref = F.conv2d(h, w2, b2, padding=1)
    assert ((_projected(h, wp, b2) - ref).norm() / ref.norm()).item() < 2e-3
    transposed = wp[:27].view(3, 3, 3, 64).transpose(0, 1).reshape(27, 64)
    assert ((_projected(h, F.pad(transposed, (0, 0, 0, 5)), b2) - ref).norm() / ref.norm()).item() > 0.1


def test_the_kernel_refuses_what_it_does_not_cover():
    x = torch.zeros(1, 64, 4, 4)
    assert "sm_90" in cuda_tail.unsupported_reason(x, torch.zeros(64, 64, 3, 3), torch.zeros(3, 64, 3, 3), 1)
    assert "sm_90" in cuda_tail.weights_reason(torch.zeros(64, 64, 3, 3), torch.zeros(3, 64, 3, 3), 1)



def test_a_cpu_model_with_fused_tail_runs_pytorch():
    """fused_tail on a model the kernel cannot take (here: the CPU) changes nothing: the same frames."""
    from taesd_fast import TAEHV

    model = TAEHV("taew2_1").eval()
    z = torch.randn(1, 2, 16, 3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model.decode_video(z)
        model.fused_tail = True
        assert model._tail_start(z[:, 0]) is None
        assert torch.equal(model.decode_video(z), plain)
