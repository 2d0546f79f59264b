"""Attention over a paged KV cache.

The KV cache of one layer is a flat tensor of slots ``[num_slots, kv_heads, head_dim]``; a
sequence's tokens live in the slots its block table names. Each forward first writes the new
tokens' K/V into their slots, then queries attend to their sequence's cached keys and to the new
keys the context's mask allows (causal, a drafter's full block, or a DDTree ancestor mask).

On CUDA the Triton kernel in ``triton_attention`` runs (it reads the pages in place and is
CUDA-graph safe); elsewhere the padded torch reference below does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.context import AttentionContext
from ddtree.kernels import triton_enabled


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        ctx: AttentionContext, scale: float) -> torch.Tensor:
    """Padded torch path: queries into [N, H, Q, D], keys gathered into [N, K]; one SDPA call."""
    key_slots, allowed, rows = ctx.dense()
    T, H, D = q.shape
    N, Q = ctx.num_seqs, ctx.max_queries
    padded = q.new_zeros(N * Q, H, D)
    padded[rows] = q
    padded = padded.view(N, Q, H, D).transpose(1, 2)
    K = key_slots.shape[1]
    keys = k_cache[key_slots.reshape(-1)].view(N, K, *k_cache.shape[1:]).to(q.dtype).transpose(1, 2)
    vals = v_cache[key_slots.reshape(-1)].view(N, K, *v_cache.shape[1:]).to(q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(padded, keys, vals, attn_mask=allowed[:, None], scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(N * Q, H, D)[rows]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: AttentionContext, scale: float) -> torch.Tensor:
    """q [T, H, D] of the new tokens, whose K/V are already stored; returns [T, H, D]."""
    if triton_enabled(q):
        from ddtree.kernels.triton_attention import tree_attention
        return tree_attention(q, k_cache, v_cache, ctx, scale)
    return reference_attention(q, k_cache, v_cache, ctx, scale)
