"""Tree attention over vLLM's CPU paged KV cache.

vLLM's CPU attention kernel takes only a causal flag, so during a DDTree verify forward the
target's attention layers run this torch path instead: every query row attends to its request's
committed prefix and, among the tokens of this step, to the rows the step's mask allows (the
ancestor mask for a tree, the causal triangle for prompt chunks and plain decodes). The new K/V
are already in the cache (vLLM writes them before calling the attention), so keys are read back
from the cache by block table, in the kernel's own layout (read off the kernel, `cache_layout`).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch


@dataclass
class StepMasks:
    """Masks of one verify forward: per request, None (causal) or a bool [q, q] mask over the
    request's scheduled rows (row i may see row j)."""
    per_request: list[torch.Tensor | None]
    layer_names: frozenset[str]  # the target's attention layers (the drafter's keep the kernel)


_state = threading.local()


class active_masks:
    """Context manager: route the target's attention through the tree path for one forward."""

    def __init__(self, masks: StepMasks):
        self.masks = masks

    def __enter__(self):
        _state.masks = self.masks

    def __exit__(self, *exc):
        _state.masks = None


def current_masks() -> StepMasks | None:
    return getattr(_state, "masks", None)


@functools.lru_cache(maxsize=None)
def cache_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype):
    """Where vLLM's CPU kernel stores token t, channel d of one head inside a cache block.

    The layout depends on the kernel's ISA (e.g. "vec" keeps keys transposed), so it is read off
    the kernel itself: token and channel numbers are written through `cpu_attn_reshape_and_cache`
    into a scratch block and found again. Returns (key_index, value_index), each LongTensor
    [block_size, head_size] of offsets into a head's block region (block_size * 2 * head_size)."""
    from vllm import _custom_ops as ops

    if max(block_size, head_size) > 256 and dtype == torch.bfloat16:
        raise ValueError("ddtree: cannot probe the CPU KV layout exactly for bf16 with blocks/heads > 256")
    region = block_size * 2 * head_size
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kv = cache.view(1, 1, 2 * block_size, head_size)
    key_cache, value_cache = kv.chunk(2, dim=2)
    t_code = (torch.arange(block_size, dtype=dtype) + 1)[:, None, None].expand(block_size, 1, head_size)
    d_code = (torch.arange(head_size, dtype=dtype) + 1)[None, None, :].expand(block_size, 1, head_size)
    zero = torch.zeros(block_size, 1, head_size, dtype=dtype)
    slots = torch.arange(block_size, dtype=torch.long)

    def where(probe_key: bool, code: torch.Tensor) -> torch.Tensor:
        cache.zero_()
        k, v = (code, zero) if probe_key else (zero, code)
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slots,
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return cache.reshape(region).float().round().long() - 1

    out = []
    for probe_key in (True, False):
        t, d = where(probe_key, t_code), where(probe_key, d_code)
        used = (t >= 0).nonzero().squeeze(1)
        index = torch.full((block_size, head_size), -1, dtype=torch.long)
        index[t[used], d[used]] = used
        if used.numel() != block_size * head_size or bool((index < 0).any()):
            raise ValueError(f"ddtree: unexpected CPU KV cache layout for isa={isa}")
        out.append(index)
    return tuple(out)


def block_regions(kv_cache: torch.Tensor) -> torch.Tensor:
    """[blocks, kv_heads, block_size, 2*head] -> [blocks, kv_heads, block region]."""
    return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)


def _as_block(index: torch.Tensor):
    """(offset, transposed) when ``index`` is one contiguous [bs, D] or [D, bs] plane, else None."""
    bs, d = index.shape
    base = int(index[0, 0])
    t, c = torch.arange(bs)[:, None], torch.arange(d)[None, :]
    if torch.equal(index, base + t * d + c):
        return base, False
    if torch.equal(index, base + c * bs + t):
        return base, True
    return None


def gather_tokens(regions: torch.Tensor, index: torch.Tensor, block_row: torch.Tensor,
                  length: int) -> torch.Tensor:
    """K (or V) of positions 0..length-1 of one request: [kv_heads, length, head]."""
    block_size, head = index.shape
    n_blocks = (length + block_size - 1) // block_size
    blocks = regions[block_row[:n_blocks].long()]  # [n, H, region]
    plane = _plane_of(index)
    if plane is None:
        x = blocks[:, :, index]  # [n, H, bs, D], any layout
    else:
        offset, transposed = plane
        x = blocks[:, :, offset:offset + block_size * head]
        x = (x.view(n_blocks, -1, head, block_size).transpose(-1, -2) if transposed
             else x.view(n_blocks, -1, block_size, head))
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], n_blocks * block_size, head)[:, :length]


_planes: dict[int, tuple[int, bool] | None] = {}


def _plane_of(index: torch.Tensor):
    key = id(index)  # layouts are cached tensors, so their ids are stable
    if key not in _planes:
        _planes[key] = _as_block(index)
    return _planes[key]


def move_tokens(kv_cache: torch.Tensor, layout, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of cache slots ``src`` to slots ``dst`` (all heads)."""
    regions = block_regions(kv_cache)
    block_size = layout[0].shape[0]
    for index in layout:
        src_off, dst_off = index[src % block_size], index[dst % block_size]  # [m, D]
        values = regions[(src // block_size)[:, None], :, src_off]           # [m, D, H]
        regions[(dst // block_size)[:, None], :, dst_off] = values


def tree_attention(query, kv_cache, layout, metadata, masks: StepMasks, scale: float, output):
    """query [T, Hq, D]; writes output [T, Hq, D] row by row per request."""
    regions = block_regions(kv_cache)
    key_index, value_index = layout
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    heads = query.shape[1]
    for r, step_mask in enumerate(masks.per_request):
        q0, q1 = starts[r], starts[r + 1]
        q_len, length = q1 - q0, seq_lens[r]
        if q_len == 0:
            continue
        prefix = length - q_len
        k = gather_tokens(regions, key_index, metadata.block_table[r], length)
        v = gather_tokens(regions, value_index, metadata.block_table[r], length)
        kv_heads = k.shape[0]
        groups = heads // kv_heads
        new = step_mask if step_mask is not None else torch.ones(
            q_len, q_len, dtype=torch.bool, device=query.device).tril()
        mask = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=query.device), new], 1)
        # Grouped-query attention without repeating K/V: the query heads sharing a KV head are
        # stacked along the rows. Plain matmuls: faster than SDPA's masked path for these sizes.
        q = query[q0:q1].transpose(0, 1).reshape(kv_heads, groups * q_len, -1)
        scores = torch.matmul(q, k.to(q.dtype).transpose(1, 2)) * scale
        scores.masked_fill_(~mask.repeat(groups, 1), float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v.to(q.dtype)).view(heads, q_len, -1)
        output[q0:q1].copy_(o.transpose(0, 1))
    return output


def install_attention_hook() -> None:
    """Wrap the CPU attention forward: tree path while a verify forward is active, else vLLM's."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward
    if getattr(original, "_ddtree", False):
        return

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        masks = current_masks()
        if masks is None or attn_metadata is None or getattr(layer, "layer_name", None) not in masks.layer_names:
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.sliding_window != -1 or self.alibi_slopes is not None or self.sinks is not None \
                or self.logits_soft_cap or self.is_fp8_kv_cache:
            raise ValueError("ddtree: tree attention supports plain causal attention only "
                             "(no sliding window, ALiBi, sinks, soft-cap or fp8 KV cache)")
        n = attn_metadata.num_actual_tokens
        layout = cache_layout(layer.isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
        tree_attention(query[:n], kv_cache, layout, attn_metadata, masks, self.scale, output[:n])
        return output

    forward._ddtree = True
    CPUAttentionBackendImpl.forward = forward
