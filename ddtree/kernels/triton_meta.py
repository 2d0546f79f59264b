"""Per-forward metadata of a decode step in one launch (CUDA path of ``AttentionContext.uniform``).

A step's target verify, drafter block and drafter context update each need their new tokens'
cache slots, positions and rotary rows. In torch that is about fifteen kernels of a few elements
each per forward (arange, add, divide, clamp, gather, multiply, modulo; cos and sin), which at
batch 1 cost more GPU time than some of the layers' kernels: here it is one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _uniform_meta_kernel(TABLES, CACHED, DEPTHS, SLOTS, POS, ROPE, ROPE_TABLE, stride_tab, stride_cl,
                         stride_dep, num_new, width, last_row, PAGE: tl.constexpr, Q_P2: tl.constexpr,
                         HAS_DEPTHS: tl.constexpr, ROPE_W: tl.constexpr, ROPE_W_P2: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, Q_P2)
    ok = q < num_new
    start = tl.load(CACHED + n * stride_cl)
    at = start + q  # the k-th new token's cache position (tree nodes are stored in node order)
    block = tl.minimum(at // PAGE, width - 1)
    page = tl.load(TABLES + n * stride_tab + block, mask=ok, other=0)
    out = n * num_new + q
    tl.store(SLOTS + out, page * PAGE + at % PAGE, mask=ok)
    if HAS_DEPTHS:  # a tree's node sits at its depth below the root
        pos = start + tl.load(DEPTHS + n * stride_dep + q, mask=ok, other=0)
    else:
        pos = at
    tl.store(POS + out, pos, mask=ok)
    if ROPE_W > 0:
        # Clamped so that a position past the table (it is sized past any position a step
        # reaches) reads its last row instead of memory outside it.
        row = tl.minimum(tl.maximum(pos, 0), last_row)
        c = tl.arange(0, ROPE_W_P2)
        m = ok[:, None] & (c[None, :] < ROPE_W)
        vals = tl.load(ROPE_TABLE + row[:, None] * ROPE_W + c[None, :], mask=m, other=0.0)
        tl.store(ROPE + out[:, None] * ROPE_W + c[None, :], vals, mask=m)


def uniform_meta(tables: torch.Tensor, cached_lens: torch.Tensor, num_new: int, block_size: int,
                 depths: torch.Tensor | None = None, rope_table: torch.Tensor | None = None):
    """-> (slots [N*num_new], positions [N*num_new], rope rows [N*num_new, W] or None), as
    ``AttentionContext.uniform``'s torch path computes them."""
    N, device = tables.shape[0], tables.device
    slots = torch.empty(N * num_new, dtype=torch.long, device=device)
    positions = torch.empty(N * num_new, dtype=torch.long, device=device)
    rope_w = 0 if rope_table is None else rope_table.shape[1]
    rope = None if rope_table is None else torch.empty(N * num_new, rope_w, dtype=rope_table.dtype, device=device)
    if N == 0 or num_new == 0:
        return slots, positions, rope
    if depths is not None and depths.stride(-1) != 1:
        depths = depths.contiguous()
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    q_p2 = triton.next_power_of_2(num_new)
    _uniform_meta_kernel[(N,)](
        tables, cached_lens, depths if depths is not None else cached_lens, slots, positions,
        rope if rope is not None else slots, rope_table if rope_table is not None else slots,
        tables.stride(0), cached_lens.stride(0), depths.stride(0) if depths is not None else 0,
        num_new, tables.shape[1], (rope_table.shape[0] - 1) if rope_table is not None else 0,
        PAGE=block_size, Q_P2=q_p2, HAS_DEPTHS=depths is not None, ROPE_W=rope_w,
        ROPE_W_P2=triton.next_power_of_2(max(rope_w, 1)),
        num_warps=4 if q_p2 * max(rope_w, 1) >= 2048 else 1)
    return slots, positions, rope
