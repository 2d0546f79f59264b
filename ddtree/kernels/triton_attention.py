"""Triton tree attention over the paged KV cache (prefill, decode, drafter block, DDTree verify).

One program handles one sequence, one KV head and a tile of its new-token queries, with the
query heads that share the KV head stacked as rows (GQA: K/V are read once per group). It walks
the sequence's keys page by page straight from the cache (no gather), applies the context's mask
to the new keys (causal, full, or the dense ancestor mask of a tree) and keeps an online softmax.
All lengths are read from tensors, so the launch is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.context import AttentionContext

_MASK_IDS = {"causal": 0, "full": 1, "tree": 2}


@triton.jit
def _tree_attention_kernel(
        Q, K, V, O, tables, cached_lens, query_start, tree_mask, scale_log2,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        stride_tab, stride_cl, stride_mn, stride_mq,
        PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(2)
    QPB: tl.constexpr = BLOCK_M // GROUP  # queries per program
    q0 = tl.load(query_start + seq)
    n_new = tl.load(query_start + seq + 1) - q0
    ctx_len = tl.load(cached_lens + seq * stride_cl)
    first_q = tl.program_id(1) * QPB

    rows = tl.arange(0, BLOCK_M)
    qi = first_q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < QPB * GROUP) & (qi < n_new)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q0 + qi)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    if MASK == 0:  # causal: this tile's last query sees up to its own position
        kv_end = ctx_len + tl.minimum(first_q + QPB, n_new)
    else:
        kv_end = ctx_len + n_new
    kv_end = tl.where(first_q < n_new, kv_end, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < kv_end
        page = tl.load(tables + seq * stride_tab + pos // PAGE, mask=in_range, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=in_range[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        rel = pos - ctx_len  # offset among the new tokens (< 0: cached, always visible)
        if MASK == 0:
            ok = rel[None, :] <= qi[:, None]
        elif MASK == 1:
            ok = rel[None, :] < n_new
        else:
            is_new = (rel >= 0) & in_range
            bits = tl.load(tree_mask + seq * stride_mn + qi[:, None] * stride_mq + rel[None, :],
                           mask=row_ok[:, None] & is_new[None, :], other=0)
            ok = (rel[None, :] < 0) | (bits != 0)
        ok = ok & in_range[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=in_range[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (q0 + qi)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   ctx: AttentionContext, scale: float) -> torch.Tensor:
    """q [T, H, D] (new tokens, K/V already in the cache) -> [T, H, D]."""
    T, H, D = q.shape
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    block_m = min(64, max(16, triton.next_power_of_2(ctx.max_queries * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    out = torch.empty_like(q)
    tree_mask = ctx.tree_mask if ctx.mask == "tree" else ctx.cached_lens
    mask_strides = (tree_mask.stride(0), tree_mask.stride(1)) if ctx.mask == "tree" else (0, 0)
    grid = (ctx.num_seqs, triton.cdiv(ctx.max_queries, block_m // group), kv_heads)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, ctx.block_tables, ctx.cached_lens, ctx.query_start, tree_mask,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), ctx.block_tables.stride(0), ctx.cached_lens.stride(0), *mask_strides,
        PAGE=ctx.block_size, GROUP=group, BLOCK_M=block_m, BLOCK_N=64 if D <= 64 else 32,
        HEAD_DIM=D, MASK=_MASK_IDS[ctx.mask], IEEE=q.dtype == torch.float32,
        num_warps=4)
    return out
