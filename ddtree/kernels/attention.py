"""Attention over a paged KV cache (torch reference path; runs on CPU and CUDA).

The KV cache of one layer is a flat tensor of slots ``[num_slots, kv_heads, head_dim]``; a
sequence's tokens live in the slots its block table names. Each forward writes the new tokens'
K/V into their slots, then every query attends to (a) all cached tokens of its sequence before the
new ones and (b) the new tokens allowed by the step's mask: causal for prefill/decode, the
ancestor mask for a DDTree verify.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.context import AttentionContext


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, ctx: AttentionContext, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of the new tokens (already stored); returns [T, H, D]."""
    out = torch.empty_like(q)
    for i in range(ctx.num_seqs):
        qs, qe = ctx.query_starts[i], ctx.query_starts[i + 1]
        n_new = qe - qs
        cached = ctx.cached_lens[i]
        old_slots = ctx.cached_slots[i]
        keys = torch.cat([k_cache.index_select(0, old_slots).to(q.dtype), k[qs:qe]], 0) if cached else k[qs:qe]
        vals = torch.cat([v_cache.index_select(0, old_slots).to(q.dtype), v[qs:qe]], 0) if cached else v[qs:qe]
        if ctx.tree_mask is not None:
            new_mask = ctx.tree_mask[i, :n_new, :n_new]
        else:
            new_mask = torch.ones(n_new, n_new, dtype=torch.bool, device=q.device).tril_()
        mask = torch.cat([torch.ones(n_new, cached, dtype=torch.bool, device=q.device), new_mask], 1)
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1)
    return out


def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                    scale: float) -> torch.Tensor:
    """Non-causal drafter attention: each block of queries sees its sequence's cached context K/V
    and every position of its own block. Block K/V are not stored (DFlash drops them)."""
    out = torch.empty_like(q)
    for i in range(ctx.num_seqs):
        qs, qe = ctx.query_starts[i], ctx.query_starts[i + 1]
        old_slots = ctx.cached_slots[i]
        keys = torch.cat([k_cache.index_select(0, old_slots).to(q.dtype), k_new[qs:qe]], 0)
        vals = torch.cat([v_cache.index_select(0, old_slots).to(q.dtype), v_new[qs:qe]], 0)
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1)
    return out
