"""Tree attention over vLLM's paged KV cache (CPU backend; FlashAttention / Triton on GPU).

vLLM's attention kernels take only a causal flag, so during a DDTree verify forward the target's
attention layers run this torch path instead: every query row attends to its request's committed
prefix and, among the tokens of this step, to the rows the step's mask allows (the ancestor mask
for a tree, the causal triangle for prompt chunks and plain decodes). The new K/V are already in
the cache (vLLM writes them before calling the attention), so keys are read back from the cache by
block table: on CPU in the kernel's own layout (read off the kernel, `cache_layout`); on GPU from
the logical [blocks, kv_heads, block_size, 2 * head] view vLLM's FlashAttention and Triton backends
share (key = channels :head, value = head:), whatever its physical stride order.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionPlan:
    """One attention call of a verify forward, the same for every target layer: ``count``
    requests with ``q`` rows each, on consecutive rows q0..q1 of the batch (a run of tree
    requests of one budget is batched into one call; other requests get one call each)."""
    q0: int
    q1: int
    q: int                      # rows per request
    count: int
    length: int                 # keys read per request: positions 0..length-1
    blocks: torch.Tensor        # LongTensor [count * n]: each request's first n cache blocks
    bias: torch.Tensor | None   # count == 1: [groups * q, q] additive mask (0 / -inf) over the
                                # request's own rows (the last q keys), None when q == 1;
                                # count > 1: [count, groups * q, length], over all keys


@dataclass
class StepMasks:
    """Masks of one verify forward: per request, None (causal) or a bool [q, q] mask over the
    request's scheduled rows (row i may see row j)."""
    per_request: list[torch.Tensor | None]
    layer_names: frozenset[str]  # the target's attention layers (the drafter's keep the kernel)
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, metadata, groups: int, block_size: int, dtype: torch.dtype) -> list[AttentionPlan]:
        """Attention calls of this forward, built once: every target layer shares the metadata."""
        key = (id(metadata), groups, block_size, dtype)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is metadata:
            return hit[1]
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        runs: list[list[int]] = []  # adjacent requests with the same (> 1) number of rows
        last_q = 0
        for r in range(len(self.per_request)):
            q = starts[r + 1] - starts[r]
            if q > 1 and q == last_q:
                runs[-1].append(r)
            elif q > 0:
                runs.append([r])
            last_q = q
        plans = [self._run_plan(run, starts, seq_lens, metadata.block_table, groups, block_size, dtype)
                 for run in runs]
        self._plans[key] = (metadata, plans)
        return plans

    def _run_plan(self, run, starts, seq_lens, block_table, groups, block_size, dtype) -> AttentionPlan:
        q = starts[run[0] + 1] - starts[run[0]]
        length = max(seq_lens[r] for r in run)
        n = (length + block_size - 1) // block_size
        blocks = block_table[run[0]:run[-1] + 1, :n].long().reshape(-1)
        own = []  # per request: [q, q] additive mask over its own rows
        for r in run:
            allowed = self.per_request[r]
            allowed = torch.ones(q, q, dtype=torch.bool).tril() if allowed is None else allowed.cpu()
            own.append(torch.zeros(q, q, dtype=dtype).masked_fill_(~allowed, float("-inf")))
        if len(run) == 1:
            bias = own[0].repeat(groups, 1) if q > 1 else None
        else:
            # Keys past a request's own length (it may be shorter than the longest) are masked.
            bias = torch.full((len(run), q, length), float("-inf"), dtype=dtype)
            for i, r in enumerate(run):
                prefix = seq_lens[r] - q
                bias[i, :, :prefix] = 0
                bias[i, :, prefix:seq_lens[r]] = own[i]
            bias = bias.repeat(1, groups, 1)
        if bias is not None:
            bias = bias.to(blocks.device)
        return AttentionPlan(starts[run[0]], starts[run[-1] + 1], q, len(run), length, blocks, bias)


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


def gather_tokens(regions: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor, count: int,
                  length: int):
    """K (or V) of positions 0..length-1 of ``count`` requests, read from their cache ``blocks``
    ([count * n], n blocks each).

    Returns (x, transposed): x is [count * kv_heads, length, head], or [count * kv_heads, head,
    length] when the cache stores this plane transposed (no transpose copy is made then: the
    caller multiplies by it as it is). n = 1: views of one index_select; else one more copy."""
    block_size, head = index.shape
    num_blocks, kv_heads = regions.shape[:2]
    n = blocks.numel() // count
    plane = _plane_of(index)
    if plane is None:  # any layout: gather element by element
        x, transposed = regions.index_select(0, blocks)[:, :, index], False  # [count*n, H, bs, D]
    else:
        offset, transposed = plane
        planes = regions[:, :, offset:offset + block_size * head]
        shape = (head, block_size) if transposed else (block_size, head)
        x = planes.view(num_blocks, kv_heads, *shape).index_select(0, blocks)
    # [count*n, H, a, b] -> [count*H, a, n*bs] (transposed) or [count*H, n*bs, b]
    if transposed:
        x = x.view(count, n, kv_heads, head, block_size).permute(0, 2, 3, 1, 4)
        return x.reshape(count * kv_heads, head, n * block_size)[:, :, :length], True
    x = x.view(count, n, kv_heads, block_size, head).transpose(1, 2)
    return x.reshape(count * kv_heads, n * block_size, head)[:, :length], False


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


def move_tokens_logical(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slots ``src`` to ``dst`` (all heads, K and V) in a logical [blocks, kv_heads,
    block_size, 2 * head] cache; indexing is logical, so any physical stride order works."""
    block_size = kv_cache.shape[2]
    values = kv_cache[src // block_size, :, src % block_size]   # [m, H, 2D] (a copy)
    kv_cache[dst // block_size, :, dst % block_size] = values


def gather_logical(kv_cache: torch.Tensor, blocks: torch.Tensor, count: int, length: int):
    """K and V of positions 0..length-1 of ``count`` requests from a logical [blocks, kv_heads,
    block_size, 2 * head] cache: each [count * kv_heads, length, head], not transposed."""
    _, kv_heads, block_size, two_head = kv_cache.shape
    head = two_head // 2
    n = blocks.numel() // count
    x = kv_cache.index_select(0, blocks.to(kv_cache.device))     # [count*n, H, bs, 2D]
    x = x.reshape(count, n, kv_heads, block_size, two_head).transpose(1, 2)
    x = x.reshape(count * kv_heads, n * block_size, two_head)[:, :length]
    return (x[..., :head], False), (x[..., head:], False)


def cpu_gather(kv_cache: torch.Tensor, layout):
    """The K/V reader of a CPU cache in the probed ``layout`` (see `gather_logical`)."""
    regions = block_regions(kv_cache)
    key_index, value_index = layout

    def gather(blocks, count, length):
        return (gather_tokens(regions, key_index, blocks, count, length),
                gather_tokens(regions, value_index, blocks, count, length))
    return gather


def tree_attention(query, gather, kv_heads: int, plans: list[AttentionPlan], scale: float, output):
    """query [T, Hq, D]; writes output [T, Hq, D], one batched call per plan. ``gather(blocks,
    count, length)`` reads a plan's keys and values ((x, transposed) each, `gather_tokens`).

    Every row attends to its request's committed prefix (no mask) and to the step's own rows
    through the plan's additive bias. Grouped-query attention without repeating K/V: the query
    heads sharing a KV head are stacked along the rows. Plain batched matmuls: faster than SDPA's
    masked path at these sizes."""
    heads, head = query.shape[1], query.shape[2]
    groups = heads // kv_heads
    for p in plans:
        R, q = p.count, p.q
        (k, k_t), (v, v_t) = gather(p.blocks, R, p.length)
        qs = torch.empty(R, heads, q, head, dtype=query.dtype, device=query.device)
        torch.mul(query[p.q0:p.q1].view(R, q, heads, head).transpose(1, 2), scale, out=qs)
        scores = torch.bmm(qs.view(R * kv_heads, groups * q, head), k if k_t else k.transpose(1, 2))
        if p.bias is not None:
            if R == 1:
                scores[:, :, p.length - q:].add_(p.bias)
            else:
                scores.view(R, kv_heads, groups * q, -1).add_(p.bias[:, None])
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.bmm(probs, v.transpose(1, 2) if v_t else v)  # [R*Hkv, G*q, D]
        output[p.q0:p.q1].view(R, q, heads, head).copy_(o.view(R, heads, q, head).transpose(1, 2))
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
        block_size = kv_cache.shape[2]
        layout = cache_layout(layer.isa, block_size, self.head_size, kv_cache.dtype)
        plans = masks.plan(attn_metadata, query.shape[1] // kv_cache.shape[1], block_size, query.dtype)
        tree_attention(query[:n], cpu_gather(kv_cache, layout), kv_cache.shape[1], plans, self.scale,
                       output[:n])
        return output

    forward._ddtree = True
    CPUAttentionBackendImpl.forward = forward


def plain_causal(impl) -> bool:
    """Whether a vLLM GPU attention impl computes plain causal softmax attention (what the tree
    path reproduces): no sliding window, ALiBi, sinks, soft-cap or quantized KV cache."""
    window = getattr(impl, "sliding_window", None)
    windows = window if isinstance(window, (tuple, list)) else (window,)
    return (all(w in (None, -1) for w in windows) and getattr(impl, "alibi_slopes", None) is None
            and getattr(impl, "sinks", None) is None and not getattr(impl, "logits_soft_cap", None)
            and getattr(impl, "kv_cache_dtype", "auto") == "auto")


def gpu_tree_forward(impl, query, kv_cache, attn_metadata, output, masks: StepMasks):
    """The tree path of one target layer over a logical [blocks, kv_heads, block_size, 2 * head]
    cache (vLLM's FlashAttention / Triton backends); query [T(+padding), Hq, D]."""
    if not plain_causal(impl):
        raise ValueError("ddtree: tree attention supports plain causal attention only "
                         "(no sliding window, ALiBi, sinks, soft-cap or fp8 KV cache)")
    n = attn_metadata.num_actual_tokens
    block_size = kv_cache.shape[2]
    plans = masks.plan(attn_metadata, query.shape[1] // kv_cache.shape[1], block_size, query.dtype)
    gather = lambda blocks, count, length: gather_logical(kv_cache, blocks, count, length)  # noqa: E731
    out = output[:n].view(n, query.shape[1], -1)
    tree_attention(query[:n].view(n, query.shape[1], -1), gather, kv_cache.shape[1], plans, impl.scale, out)
    return output


def install_gpu_attention_hook() -> None:
    """Wrap the forward of vLLM's FlashAttention and Triton attention impls (the GPU backends
    whose caches `gather_logical` reads): tree path while a verify forward is active."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    impls = [TritonAttentionImpl]
    with contextlib.suppress(ImportError):  # a vLLM built without FlashAttention
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
        impls.append(FlashAttentionImpl)
    for cls in impls:
        original = cls.forward
        if getattr(original, "_ddtree", False):
            continue

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                    _original=original, **kwargs):
            masks = current_masks()
            if masks is None or attn_metadata is None or getattr(layer, "layer_name", None) not in masks.layer_names:
                return _original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            return gpu_tree_forward(self, query, kv_cache, attn_metadata, output, masks)

        forward._ddtree = True
        cls.forward = forward
