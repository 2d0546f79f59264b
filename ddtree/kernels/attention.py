"""Attention over a paged KV cache (torch reference path; runs on CPU and CUDA).

The KV cache of one layer is a flat tensor of slots ``[num_slots, kv_heads, head_dim]``; a
sequence's tokens live in the slots its block table names. Each forward first writes the new
tokens' K/V into their slots, then queries attend to the keys and mask the context names: all
cached tokens of their sequence plus the new tokens allowed by the step (causal for prefill,
the ancestor mask for a DDTree verify, the whole block for the drafter).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.context import AttentionContext


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _pad_queries(q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    T, H, D = q.shape
    padded = q.new_zeros(ctx.num_seqs * ctx.max_queries, H, D)
    padded[ctx.query_rows] = q
    return padded.view(ctx.num_seqs, ctx.max_queries, H, D).transpose(1, 2)  # [N, H, Q, D]


def _gather_keys(cache: torch.Tensor, ctx: AttentionContext, dtype) -> torch.Tensor:
    N, K = ctx.key_slots.shape
    return cache[ctx.key_slots.reshape(-1)].view(N, K, *cache.shape[1:]).to(dtype)


def _attend(q, keys, vals, ctx, scale):
    o = F.scaled_dot_product_attention(q, keys.transpose(1, 2), vals.transpose(1, 2),
                                       attn_mask=ctx.mask[:, None], scale=scale, enable_gqa=True)
    H, D = o.shape[1], o.shape[3]
    return o.transpose(1, 2).reshape(-1, H, D)[ctx.query_rows]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: AttentionContext, scale: float) -> torch.Tensor:
    """q [T, H, D] of the new tokens, whose K/V are already stored; returns [T, H, D]."""
    return _attend(_pad_queries(q, ctx), _gather_keys(k_cache, ctx, q.dtype),
                   _gather_keys(v_cache, ctx, q.dtype), ctx, scale)


def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                    scale: float) -> torch.Tensor:
    """Non-causal drafter attention: each block of queries sees its sequence's cached context K/V
    and every position of its own block. Block K/V are not stored (DFlash drops them)."""
    N, S = ctx.num_seqs, ctx.max_queries
    keys = torch.cat([_gather_keys(k_cache, ctx, q.dtype), k_new.view(N, S, *k_new.shape[1:])], 1)
    vals = torch.cat([_gather_keys(v_cache, ctx, q.dtype), v_new.view(N, S, *v_new.shape[1:])], 1)
    return _attend(_pad_queries(q, ctx), keys, vals, ctx, scale)
