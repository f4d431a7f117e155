"""taesd_fast::block_chain: a run of TAESD Blocks (64 -> 64 channels, identity skip, no pool branch) at one
resolution in one persistent Triton kernel, for small images (live previews at B=1).

    h = x;  for each block: h = relu(c3(relu(c2(relu(c1(h))))) + h)      ci(h) = conv3x3(h, w_i, b_i)
    x: [B, 64, H, W] f16 channels_last;  ws, bs: 3 * n_blocks weights [64, 64, 3, 3] f16 and biases [64] f16
    Each conv's output is rounded to f16, as in the per-conv path. `block_chain_ref` is the PyTorch twin.

Why: a 256^2 decode at B=1 runs ~40 kernels and its 32^2-128^2 levels are launch-bound: a 64 -> 64 conv at 32^2
takes 3.2 us per launch in a chain of launches (programmatic dependent launch on), of which ~2.3 us is what any
kernel costs there (the 1-step 4 -> 64 conv takes that), and the decode spends 4.0-6.3 us per conv at those levels
(scripts/decode_timeline.py, BENCHMARKS.md). Here one launch runs all 3 * n_blocks convs: programs loop over
64-pixel tiles with conv_tc's tap loop and epilogue, intermediates go to a scratch buffer in L2, and the programs
meet at a grid-wide barrier (one atomic counter) between convs. That needs every program resident at once: the
grid is at most `per_sm` programs per SM (shared memory and registers allow more on sm_80+).

Predicted (before it ran; H200): a conv inside the chain costs its tap loop (~1 us) plus a barrier (~1 us) instead
of 4-6 us: the 27 Block convs of a 256^2 decode from ~140 us to ~60-80 us (decode 0.215 -> ~0.15 ms).

Memory order: writes before the barrier are released by the arriving thread's atomic (after a CTA barrier, so they
are cumulative), and read after the waiting thread's acquire (then a CTA barrier). Input and residual loads bypass
L1 (.cg): a buffer is rewritten by other programs between reads.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .conv_tc import (_interpreting, _new_out, conv3x3_math, pack_weight, _plan, pdl_args, triton,
                      triton_unavailable_reason)
from .derived import derived

if triton is not None:
    import triton.language as tl

    from .conv_tc import _epilogue, _pdl_start, _tap_loop

__all__ = ["C", "MAX_BLOCKS", "block_chain", "block_chain_ref", "launch", "unsupported_reason", "shape_reason", "spec_ready"]

C = 64  # channels of every conv in the chain
MAX_BLOCKS = 3  # per launch (TAESD's levels have 3 Blocks; longer runs take several launches)
MAX_PIXELS = 1 << 20  # B*H*W: beyond ~1M pixels the per-conv kernels fill the GPU anyway
BLOCK_M, NUM_WARPS, NUM_STAGES, PER_SM = 64, 4, 3, 2  # conv_tc's best small-problem config (run 1, this session)
# Cooperative launch: the driver refuses a grid whose programs cannot all be resident at once (an error instead of a
# barrier that never opens, e.g. on a GPU with less shared memory per SM).
COOPERATIVE = True
POISON_OUTPUT = False  # tests set this: NaN-fill the output (and scratch) before launch


def unsupported_reason(x_shape, dtype, n_blocks: int, device) -> str | None:
    """Why the chain kernel cannot run this call on `device`, or None. Shapes only."""
    return triton_unavailable_reason(device) or shape_reason(x_shape, dtype, n_blocks)


def shape_reason(x_shape, dtype, n_blocks: int) -> str | None:
    """Why the chain kernel cannot take these shapes (on any device), or None."""
    if dtype != torch.float16:
        return f"dtype {dtype} (the chain kernel takes torch.float16)"
    if len(x_shape) != 4 or x_shape[1] != C:
        return f"input shape {tuple(x_shape)} (expected [B, {C}, H, W])"
    if not 1 <= n_blocks <= MAX_BLOCKS:
        return f"{n_blocks} blocks (expected 1..{MAX_BLOCKS} per launch)"
    B, _, H, W = x_shape
    if min(B, H, W) < 1 or B * H * W > MAX_PIXELS:
        return f"B*H*W = {B * H * W} pixels (expected 1..{MAX_PIXELS}: larger images fill the GPU per conv)"
    return None


def _check(x: Tensor, ws, bs) -> None:
    if len(ws) != len(bs) or len(ws) % 3:
        raise ValueError(f"block_chain: expected 3 weights and 3 biases per block, got {len(ws)} and {len(bs)}")
    reason = shape_reason(x.shape, x.dtype, len(ws) // 3)
    if reason is not None:
        raise ValueError(f"block_chain: {reason}")
    for w, b in zip(ws, bs):
        if tuple(w.shape) != (C, C, 3, 3) or b is None or tuple(b.shape) != (C,):
            raise ValueError(f"block_chain: every conv must be {C}->{C} 3x3 with a bias, got weight "
                             f"{tuple(w.shape)} and bias {None if b is None else tuple(b.shape)}")
        if w.dtype != x.dtype or b.dtype != x.dtype or w.device != x.device or b.device != x.device:
            raise ValueError(f"block_chain: weights and biases must be {x.dtype} on {x.device} like x")


def block_chain_ref(x: Tensor, ws, bs) -> Tensor:
    """PyTorch twin: each conv in fp32 maths, rounded to x.dtype, as the per-conv path computes it."""
    _check(x, ws, bs)
    h = x
    for i in range(0, len(ws), 3):
        t = conv3x3_math(h, ws[i], bs[i], None, 1, True, dtype=torch.float32).to(x.dtype)
        t = conv3x3_math(t, ws[i + 1], bs[i + 1], None, 1, True, dtype=torch.float32).to(x.dtype)
        h = conv3x3_math(t, ws[i + 2], bs[i + 2], h, 1, True, dtype=torch.float32).to(x.dtype)
    return _new_out(x.shape, x).copy_(h)


if triton is not None:
    assert C == 64  # the kernel spells C as a literal: Triton reads no plain globals, and the interpreter mishandles
    #                 a constexpr global passed on to a helper

    @triton.jit
    def _grid_sync(sync_ptr, target, SYNC: tl.constexpr):
        # Every program arrives; all wait until `target` arrivals are counted (the counter only grows within a
        # launch). The scalar atomics run on one thread per program; the CTA barriers order the others around it.
        # SYNC 0: poll with acquire loads (one thread, result shared through shared memory, CTA barrier per poll);
        # SYNC 1: every thread polls with relaxed volatile loads, then one acquire load and a CTA barrier.
        tl.debug_barrier()
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        if SYNC == 0:
            while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target:
                pass
            tl.debug_barrier()
        else:
            seen = tl.load(sync_ptr, volatile=True)
            while seen < target:
                seen = tl.load(sync_ptr, volatile=True)
            tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()

    @triton.jit
    def _block_input(j: tl.constexpr, x_ptr, s_ptr, y_ptr, plane, N_BLOCKS: tl.constexpr):
        # Block j's input: x, then scratch planes 2 and 3 in turn; the last block's output is y.
        if j == 0:
            return x_ptr
        elif j == N_BLOCKS:
            return y_ptr
        else:
            return s_ptr + (2 + (j - 1) % 2) * plane

    @triton.jit(do_not_specialize=["M", "H", "W"])
    def _block_chain_kernel(x_ptr, s_ptr, y_ptr, sync_ptr, w_ptrs, b_ptrs, M, H, W,
                            N_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, SYNC: tl.constexpr, PDL: tl.constexpr):
        _pdl_start(PDL)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_tiles = tl.cdiv(M, BLOCK_M)
        plane = M.to(tl.int64) * 64  # elements of one scratch plane: 0 = first conv's output, 1 = second's
        rc = tl.arange(0, 64)
        for layer in tl.static_range(3 * N_BLOCKS):
            blk = layer // 3  # constexprs: the layers are unrolled
            k = layer % 3
            block_in = _block_input(blk, x_ptr, s_ptr, y_ptr, plane, N_BLOCKS)
            if k == 0:
                src = block_in
                dst = s_ptr
            elif k == 1:
                src = s_ptr
                dst = s_ptr + plane
            else:
                src = s_ptr + plane
                dst = _block_input(blk + 1, x_ptr, s_ptr, y_ptr, plane, N_BLOCKS)
            for tile in range(pid, n_tiles, nprog):
                rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = rm < M
                gx = rm % W
                t = rm // W
                acc = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
                acc = _tap_loop(src, w_ptrs[layer], t % H - 1, gx - 1, (t // H) * H, m_ok, H, W, rc, rc, acc,
                                64, 64, 1, 3, 64, False, ".cg")
                _epilogue(acc, b_ptrs[layer], block_in, dst, rm, m_ok, rc, 64, 64, True, k == 2, True)
            if layer + 1 < 3 * N_BLOCKS:
                _grid_sync(sync_ptr, (layer + 1) * nprog, SYNC)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _packed(w: Tensor) -> Tensor:
    """conv_tc's packed weight [1, 576, 64] (the same cache entry the per-conv path uses)."""
    plan = _plan(C, C, 1)
    return derived.get(w, ("conv_tc", 1, plan), lambda: pack_weight(w.detach(), 1, plan))


def launch(x: Tensor, ws, bs, block_m: int = BLOCK_M, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
           per_sm: int = PER_SM, sync: int = 0) -> Tensor:
    """Run the kernel (the op's CUDA body; benchmarks pass other configs). Returns channels_last y."""
    if triton is None:
        raise RuntimeError(f"block_chain: {triton_unavailable_reason()}")
    _check(x, ws, bs)
    x = x.contiguous(memory_format=torch.channels_last)
    B, _, H, W = x.shape
    M = B * H * W
    n_blocks = len(ws) // 3
    out = _new_out(x.shape, x)
    scratch = x.new_empty((4 if n_blocks > 1 else 2, M, C))
    if POISON_OUTPUT:
        out.fill_(float("nan"))
        scratch.fill_(float("nan"))
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)  # the grid barrier's arrivals
    tiles = -(-M // block_m)
    # Interpreted programs run one after another: a barrier with two of them would never open.
    launch_args = pdl_args(x)
    if _interpreting():
        grid = 1
    else:
        grid = min(tiles, per_sm * _sm_count(x.device))
        launch_args["launch_cooperative_grid"] = COOPERATIVE
    _block_chain_kernel[(grid,)](
        x, scratch, out, counter, tuple(_packed(w) for w in ws), tuple(b.contiguous() for b in bs), M, H, W,
        N_BLOCKS=n_blocks, BLOCK_M=block_m, SYNC=sync, num_warps=num_warps, num_stages=num_stages, **launch_args)
    _launched.add((str(x.device), n_blocks, block_m, num_warps, num_stages))
    return out


_launched: set = set()  # (device, n_blocks, config) of every launch: what a CUDA-graph capture can replay


def spec_ready(device, n_blocks: int) -> bool:
    return (str(torch.device(device)), n_blocks, BLOCK_M, NUM_WARPS, NUM_STAGES) in _launched


@torch.library.custom_op("taesd_fast::block_chain", mutates_args=())
def block_chain(x: Tensor, ws: list[Tensor], bs: list[Tensor]) -> Tensor:
    """See the module docstring. CUDA: the Triton kernel; CPU: the twin, or the kernel under TRITON_INTERPRET=1."""
    _check(x, ws, bs)
    if x.is_cuda or _interpreting():
        reason = triton_unavailable_reason(x.device)
        if reason is not None:
            raise RuntimeError(f"block_chain: {reason}")
        return launch(x, ws, bs)
    return block_chain_ref(x, ws, bs)


@block_chain.register_fake
def _(x, ws, bs):
    _check(x, ws, bs)
    return _new_out(x.shape, x)
