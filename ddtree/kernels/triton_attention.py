"""Triton tree attention over the paged KV cache (prefill, decode, drafter block, DDTree verify).

One program handles one sequence, one KV head and a tile of its new-token queries, with the
query heads that share the KV head stacked as rows (GQA: K/V are read once per group). It walks
the sequence's keys page by page straight from the cache (no gather) and keeps an online softmax:
first the whole tiles of cached keys, which every query sees (no mask, no bounds), then the rest
under the context's mask (causal, full, or the dense ancestor mask of a tree). All lengths are
read from tensors, so the launch is CUDA-graph safe.

Rows per query: one per head of the group (SmolLM2's 3 heads take 3 rows, so a 16-node tree fits
one 64-row tile, a 32-node tree two). With a constant 3 rows per query the H200 once stored rows
past a tile's last query despite their mask, into the next sequence's first two queries (batched
B=32 trees; the interpreter was exact), so a group that is not a power of two is divided by a
run-time value (the same regression tests pass on the H200). Small grids (batch 1-4) run the plan
that measured faster there: the group padded to a power of two and one masked loop
(``launch_plan``).

When there are fewer programs than SMs (small batches, long prefixes), the keys are split into
``splits`` ranges, one program each (flash-decoding); a second small kernel merges the partial
outputs by their log-sum-exp (all splits loaded at once: merging inside the attention kernel by
the last-arriving split measured slower on the H200, 1.15 vs 0.94 ms per batch-1 decode step).
The split count is fixed at launch (graph safe); each split's range is derived from the real
length, so short sequences just leave the last splits empty.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.context import AttentionContext
from ddtree.kernels import sm_count

_MASK_IDS = {"causal": 0, "full": 1, "tree": 2}


@triton.jit
def _attend_keys(q, acc, m_i, l_i, K, V, tables, tree_mask, start, stop, seq, kvh, ctx_len, qi, row_ok, d,
                 scale_log2, stride_ks, stride_kh, stride_vs, stride_vh, stride_tab, stride_mn, stride_mq,
                 n_new, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, MASKED: tl.constexpr,
                 IEEE: tl.constexpr):
    """Online softmax over keys [start, stop). Unmasked (MASKED False): whole key tiles of cached
    keys, which every query sees, so no bounds or mask. Masked: the rest, up to one tile of cached
    keys and the new keys under the context's mask."""
    for block in range(start, stop, BLOCK_N):
        pos = block + tl.arange(0, BLOCK_N)
        if MASKED:
            in_range = pos < stop
            page = tl.load(tables + seq * stride_tab + pos // PAGE, mask=in_range, other=0)
        else:
            page = tl.load(tables + seq * stride_tab + pos // PAGE)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        k_ptrs = K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        v_ptrs = V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if MASKED:
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
            s = tl.where(ok & in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


# Runtime ints that vary between launches are not specialised (Triton would compile a variant per
# "== 1" / "divisible by 16" pattern, a stall of ~1 s the first time a prompt length hits one).
# rows_per_query is not specialised either (ROWS, a compile-time power of two, replaces it when
# set): rows // 3 with a constant 3 is the suspected cause of the H200 storing rows past a tile's
# last query despite their mask (module docstring); divided by a run-time value, the same tests pass.
@triton.jit(do_not_specialize=["splits", "stride_tab", "stride_cl", "rows_per_query"])
def _tree_attention_kernel(
        Q, K, V, O, P, LSE, tables, cached_lens, query_start, tree_mask, scale_log2,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_tab, stride_cl, stride_mn, stride_mq,
        rows_per_query, PAGE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, UNMASKED_TILES: tl.constexpr,
        IEEE: tl.constexpr, splits):
    # splits is a runtime value (not specialised), so a new split count never recompiles.
    seq = tl.program_id(0)
    kvh = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    if ROWS > 0:  # a power of two, known when compiling (cheaper than dividing at run time)
        rows_per_query = ROWS
    qpb = BLOCK_M // rows_per_query  # queries per program
    q0 = tl.load(query_start + seq)
    n_new = tl.load(query_start + seq + 1) - q0
    ctx_len = tl.load(cached_lens + seq * stride_cl)
    first_q = tl.program_id(1) * qpb

    rows = tl.arange(0, BLOCK_M)
    qi = first_q + rows // rows_per_query
    head_in_group = rows % rows_per_query
    head = kvh * GROUP + head_in_group
    row_ok = (head_in_group < GROUP) & (rows < qpb * rows_per_query) & (qi < n_new)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q0 + qi)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    if MASK == 0:  # causal: this tile's last query sees up to its own position
        kv_end = ctx_len + tl.minimum(first_q + qpb, n_new)
    else:
        kv_end = ctx_len + n_new
    kv_end = tl.where(first_q < n_new, kv_end, 0)
    # This split's key range: equal shares rounded to whole key tiles.
    chunk = tl.cdiv(tl.cdiv(kv_end, splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    # Whole tiles of cached keys first, then the rest (as many tiles as one loop over all would
    # take) under the mask. launch_plan turns the first loop off for plain decode and small grids,
    # where a second loop cost more than the mask it saves (bench/results/attention_variants*_h200.json).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    unmasked_hi = kv_lo
    if UNMASKED_TILES:
        unmasked_hi += tl.maximum(tl.minimum(kv_hi, ctx_len) - kv_lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, K, V, tables, tree_mask, kv_lo, unmasked_hi, seq, kvh,
                                     ctx_len, qi, row_ok, d, scale_log2, stride_ks, stride_kh, stride_vs, stride_vh,
                                     stride_tab, stride_mn, stride_mq, n_new, PAGE, BLOCK_N, MASK, False, IEEE)
    acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, K, V, tables, tree_mask, unmasked_hi, kv_hi, seq, kvh, ctx_len,
                                 qi, row_ok, d, scale_log2, stride_ks, stride_kh, stride_vs, stride_vh, stride_tab,
                                 stride_mn, stride_mq, n_new, PAGE, BLOCK_N, MASK, True, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    t = (q0 + qi).to(tl.int64)
    o_ptrs = O + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if splits == 1:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        p_ptrs = P + t[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :]
        l_ptrs = LSE + t * stride_lt + head
        tl.store(p_ptrs + split * stride_ps, out, mask=row_ok[:, None])
        # log2-sum-exp of this split's scores; an empty split weighs nothing
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -1.0e30)
        tl.store(l_ptrs + split * stride_ls, lse, mask=row_ok)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(P, LSE, O, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                         splits, MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE + s * stride_ls + t * stride_lt + h, mask=s < splits, other=-1.0e30)
    w = tl.where(s < splits, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = tl.load(P + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                   mask=(s < splits)[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + t * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty))


MAX_SPLITS = 32


def kv_splits_for(programs: int, max_keys: int, max_queries: int, device: torch.device) -> int:
    """Key ranges per program: grow (powers of two, at most 32, at least 64 keys each) while the
    grid stays under 4 programs per SM for decode (memory-latency bound) or 2 per SM for trees
    and prefill (more math per key). Tuned on the H200 (bench/results/attention_sweep_h200.json)."""
    if device.type != "cuda":
        return 1
    target = (4 if max_queries == 1 else 2) * sm_count(device)
    splits = 1
    while splits < MAX_SPLITS and programs * splits * 2 <= target and max_keys >= splits * 2 * 64:
        splits *= 2
    return splits


SMALL_GRID_SPLITS = 8


def launch_plan(q: torch.Tensor, k_cache: torch.Tensor, ctx: AttentionContext, rows_per_query: int | None = None,
                block_m: int | None = None) -> tuple[int, int, int, int, bool]:
    """(rows per query, rows per program, query tiles, key splits, unmasked tiles) of a launch.

    A query takes one row per head of its GQA group and a program 16 rows, or 64 when the
    queries need more (32 measured slower than 64 on the H200 for 5-17 queries); whole tiles of
    cached keys skip the mask when there is more than one query. A grid small enough for 8+ key
    splits (batch 1-4 under a captured round's key bound) keeps the plan that measured faster
    there: the group padded to a power of two, 16/32/64 rows, one masked key loop
    (``bench/results/attention_variants*_h200.json``). ``rows_per_query`` and ``block_m``
    override the plan for such comparisons."""
    group = q.shape[1] // k_cache.shape[1]

    def plan(rows: int, m: int, unmasked_tiles: bool) -> tuple[int, int, int, int, bool]:
        tiles = triton.cdiv(ctx.max_queries, m // rows)
        return rows, m, tiles, kv_splits_for(ctx.num_seqs * tiles * k_cache.shape[1], ctx.max_keys,
                                             ctx.max_queries, q.device), unmasked_tiles

    def large_grid_plan(rows: int) -> tuple[int, int, int, int, bool]:
        m = block_m or max(triton.next_power_of_2(rows), 16 if ctx.max_queries * rows <= 16 else 64)
        return plan(rows, m, ctx.max_queries > 1)

    if rows_per_query or block_m:
        return large_grid_plan(rows_per_query or group)
    exact = large_grid_plan(group)
    if exact[3] < SMALL_GRID_SPLITS:
        return exact
    padded = triton.next_power_of_2(group)
    return plan(padded, max(padded, min(64, max(16, triton.next_power_of_2(ctx.max_queries * padded)))), False)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   ctx: AttentionContext, scale: float, splits: int | None = None,
                   rows_per_query: int | None = None, block_m: int | None = None, num_warps: int = 4,
                   unmasked_tiles: bool | None = None) -> torch.Tensor:
    """q [T, H, D] (new tokens, K/V already in the cache) -> [T, H, D]. ``splits``: key ranges
    per (sequence, head, query tile); None chooses from the grid size and ``ctx.max_keys``. The
    other keywords override the launch plan (``launch_plan``) for tuning sweeps."""
    T, H, D = q.shape
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    rows_per_query, block_m, q_tiles, auto_splits, plan_tiles = launch_plan(q, k_cache, ctx, rows_per_query, block_m)
    splits = auto_splits if splits is None else splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    out = torch.empty_like(q)
    # Rows padded to a multiple of 16 so the partials' strides keep one divisibility pattern for
    # every T (one compiled kernel); with one split they are unused but shaped alike.
    rows = triton.cdiv(T, 16) * 16 if splits > 1 else 16
    partial = torch.empty((splits, rows, H, D), device=q.device, dtype=torch.float32)
    lse = torch.empty((splits, rows, H), device=q.device, dtype=torch.float32)
    tree_mask = ctx.tree_mask if ctx.mask == "tree" else ctx.cached_lens
    mask_strides = (tree_mask.stride(0), tree_mask.stride(1)) if ctx.mask == "tree" else (0, 0)
    grid = (ctx.num_seqs, q_tiles, kv_heads * splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, partial, lse, ctx.block_tables, ctx.cached_lens, ctx.query_start,
        tree_mask, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        ctx.block_tables.stride(0), ctx.cached_lens.stride(0), *mask_strides, rows_per_query,
        PAGE=ctx.block_size, GROUP=group, ROWS=rows_per_query if rows_per_query & (rows_per_query - 1) == 0 else 0,
        BLOCK_M=block_m,
        BLOCK_N=64 if D <= 64 else 32, HEAD_DIM=D, MASK=_MASK_IDS[ctx.mask],
        UNMASKED_TILES=plan_tiles if unmasked_tiles is None else unmasked_tiles,
        IEEE=q.dtype == torch.float32,
        splits=splits, num_warps=num_warps)
    if splits > 1:
        _merge_splits_kernel[(T, H)](
            partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), splits=splits, MAX_SPLITS=MAX_SPLITS, HEAD_DIM=D,
            num_warps=1)
    return out
