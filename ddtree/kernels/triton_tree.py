"""DDTree construction as one Triton program per sequence (the CUDA path of ``build_tree_batched``).

Same beams, same tie rule, same output as the torch builder (``ddtree.tree.build``), but the ~10
kernel launches per depth become one launch for the whole tree, which also writes the root and the
ancestor mask (about 30 tiny launches in torch). Two facts keep it small:

- Per depth only pairs (parent j, rank r) with (j+1)(r+1) <= n_d can reach the top n_d: beams
  and ranks are sorted, fp32 addition is monotone and ties prefer smaller (j, r), so every pair
  (j' <= j, r' <= r) precedes (j, r). That is about n_d ln n_d candidates instead of n_prev * K.
- Order is a single int64 key: the fp32 score mapped to an order-preserving int32 in the high
  half, (max - tie index) in the low half, so one descending sort realises the tie rule.

Three cuts made the kernel 1.2-3x faster on the H200 (``scripts/device/profile_build.py
--baseline``, ``bench/results/profile_build_h200.json``; B=64, batch 1: 0.100 -> 0.033-0.044 ms):
a depth is built only while its best prefix could still enter the tree (no node deeper than d
scores above depth d's best, and equal scores go to shallower nodes, so once N_NODES shallower
entries score at least that much the tree is complete); a depth keeps its beam and the end keeps
the N_NODES best with Triton's bitonic top-k instead of full sorts; the ancestor walk gathers
parents from registers instead of global memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.tree.build import effective_budget, topk_per_depth

_LOW = 2**31 - 1
_INT64_MIN = tl.constexpr(-2**63)  # a global read inside @triton.jit must be a constexpr


@triton.jit
def _sort_key(score, tie):
    """Descending order of the key = score desc, then tie index asc."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (2147483647 - tie).to(tl.int64)


@triton.jit
def _build_tree_kernel(LP, TOK, ROOTS, SIZES, OFFS, PAIR_J, PAIR_R,
                       ALL_SCORE, ALL_TOK, ALL_PAR, INV, OUT_TOK, OUT_PAR, OUT_DEP, MASK,
                       D: tl.constexpr, K: tl.constexpr, N_NODES: tl.constexpr,
                       CAND: tl.constexpr, BEAM_P2: tl.constexpr, KP2: tl.constexpr,
                       TOTAL_P2: tl.constexpr, SEL_P2: tl.constexpr, T_P2: tl.constexpr,
                       MASK_ROWS: tl.constexpr, MAX_DEPTH: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    lp = LP + n * D * K
    tok = TOK + n * D * K
    all_score = ALL_SCORE + n * TOTAL_P2
    all_tok = ALL_TOK + n * TOTAL_P2
    all_par = ALL_PAR + n * TOTAL_P2
    inv = INV + n * TOTAL_P2

    # Depth 1: the K best tokens, already in order.
    r = tl.arange(0, KP2)
    tl.store(all_score + r, tl.load(lp + r, mask=r < K), mask=r < K)
    tl.store(all_tok + r, tl.load(tok + r, mask=r < K), mask=r < K)
    tl.store(all_par + r, tl.full([KP2], -1, tl.int32), mask=r < K)
    tl.debug_barrier()

    c = tl.arange(0, CAND)
    pj = tl.load(PAIR_J + c)
    pr = tl.load(PAIR_R + c)
    b = tl.arange(0, BEAM_P2)
    everything = tl.arange(0, TOTAL_P2)
    filled = tl.load(SIZES)  # beam entries written so far (depths 1..d)
    for d in range(1, D):
        n_prev = tl.load(SIZES + d - 1)
        n_d = tl.load(SIZES + d)
        off_prev = tl.load(OFFS + d - 1)
        off = tl.load(OFFS + d)
        # Early exit: no node at depth >= d scores above this depth's best (parent 0 + rank 0), and
        # on equal scores shallower nodes come first. Once N_NODES shallower entries score at
        # least that much, the tree is complete: the deeper beams are never built.
        best = tl.load(all_score + off_prev, mask=n_d > 0, other=0.0) + tl.load(lp + d * K)  # n_d > 0: beam d-1 exists
        shallower = tl.load(all_score + everything, mask=everything < off, other=float("-inf"))
        if (filled == off) & (n_d > 0) & (tl.sum((shallower >= best).to(tl.int32), 0) < N_NODES):
            valid = (pj < n_prev) & ((pj + 1) * (pr + 1) <= n_d)
            score = tl.load(all_score + off_prev + pj, mask=valid, other=0.0) + tl.load(lp + d * K + pr, mask=valid, other=0.0)
            key = tl.where(valid, _sort_key(score, pj * K + pr), -9223372036854775807 - 1)
            if BEAM_P2 < CAND:  # only the n_d <= BEAM_P2 best are kept
                key = tl.topk(key, BEAM_P2)
            else:
                key = tl.sort(key, descending=True)
            flat = 2147483647 - (key & 0xFFFFFFFF).to(tl.int32)
            j = flat // K
            rr = flat % K
            keep = b < n_d
            score = tl.load(all_score + off_prev + j, mask=keep, other=0.0) + tl.load(lp + d * K + rr, mask=keep, other=0.0)
            tl.store(all_score + off + b, score, mask=keep)
            tl.store(all_tok + off + b, tl.load(tok + d * K + rr, mask=keep, other=0), mask=keep)
            tl.store(all_par + off + b, (off_prev + j).to(tl.int32), mask=keep)
            filled = off + n_d
            tl.debug_barrier()

    # Global order over every beam entry: score desc, then concatenation position asc; only the
    # first N_NODES (<= SEL_P2) are needed.
    inside = everything < filled
    key = tl.where(inside, _sort_key(tl.load(all_score + everything, mask=inside, other=0.0), everything),
                   -9223372036854775807 - 1)
    if SEL_P2 < TOTAL_P2:
        key = tl.topk(key, SEL_P2)
    else:
        key = tl.sort(key, descending=True)
    pos = 2147483647 - (key & 0xFFFFFFFF).to(tl.int32)
    p = tl.arange(0, SEL_P2)
    chosen = p < N_NODES
    tl.store(inv + pos, p.to(tl.int32), mask=chosen)
    tl.debug_barrier()

    depth = tl.zeros([SEL_P2], tl.int32)
    for d in range(1, D):
        depth += (pos >= tl.load(OFFS + d)).to(tl.int32)
    parent_pos = tl.load(all_par + pos, mask=chosen, other=-1)
    parent_out = tl.load(inv + parent_pos, mask=chosen & (parent_pos >= 0), other=-1)
    # Results are in sorted order already: element p of the sorted arrays is output node p, which
    # is node p + 1 of the full tree (root at 0, its own parent).
    T: tl.constexpr = N_NODES + 1
    out_tok, out_par, out_dep = OUT_TOK + n * T, OUT_PAR + n * T, OUT_DEP + n * T
    tl.store(out_tok + 1 + p, tl.load(all_tok + pos, mask=chosen, other=0), mask=chosen)
    tl.store(out_par + 1 + p, (parent_out + 1).to(tl.int64), mask=chosen)
    tl.store(out_dep + 1 + p, (depth + 1).to(tl.int64), mask=chosen)
    tl.store(out_tok, tl.load(ROOTS + n))
    tl.store(out_par, 0)
    tl.store(out_dep, 0)
    tl.debug_barrier()

    # Ancestor mask (node itself included): follow parent pointers MAX_DEPTH times, in registers.
    cols = tl.arange(0, T_P2)
    parents = tl.load(out_par + cols, mask=cols < T, other=0).to(tl.int32)
    for r0 in range(0, T, MASK_ROWS):
        i = r0 + tl.arange(0, MASK_ROWS)
        row_ok = i < T
        cur = tl.where(row_ok, i, 0)
        m = cols[None, :] == cur[:, None]
        for _ in range(MAX_DEPTH):
            cur = tl.gather(parents, cur, 0)
            m = m | (cols[None, :] == cur[:, None])
        tl.store(MASK + n * T * T + i[:, None] * T + cols[None, :], m.to(tl.int8),
                 mask=row_ok[:, None] & (cols[None, :] < T))


@triton.jit
def _vocab_key(x, idx, V):
    """int64 key ordering (value desc, index asc): ``topk_per_depth``'s tie rule."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)


# Triton >= 3.4 has a bitonic top-k that sorts only k-element runs and halves the data between
# merges. The tree kernel above needs it (torch >= 2.11 ships Triton >= 3.6); here a full sort of
# each chunk remains for k = 1 and as the comparison of scripts/device/sweep_topk.py.
HAS_TL_TOPK = hasattr(tl, "topk")


@triton.jit
def _chunk_stats_kernel(X, STATS, stride_x, V, CHUNK: tl.constexpr):
    """Max and sum of exp(x - max) of one vocabulary chunk of one row."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + r * stride_x + idx, mask=idx < V, other=float("-inf"))
    m = tl.max(x, 0)
    dst = STATS + (r * tl.num_programs(1) + c) * 2
    tl.store(dst, m)
    tl.store(dst + 1, tl.sum(tl.exp(x - m), 0))


@triton.jit
def _chunk_threshold_kernel(STATS, THR, K, N_CHUNKS, NC_P2: tl.constexpr):
    """A row's K-th largest chunk max: the K chunks whose max is at least that hold K entries at
    least that large, so no entry of a chunk whose max is smaller is in the row's top K."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NC_P2)
    maxes = tl.load(STATS + (r * N_CHUNKS + j) * 2, mask=j < N_CHUNKS, other=float("-inf"))
    maxes = tl.sort(maxes, descending=True)
    tl.store(THR + r, tl.max(tl.where(j == K - 1, maxes, float("-inf")), 0))


@triton.jit
def _chunk_topk_kernel(X, KEYS, STATS, THR, stride_x, V, CHUNK: tl.constexpr, KP: tl.constexpr,
                       SKIP: tl.constexpr, WRITE_STATS: tl.constexpr, USE_TL_TOPK: tl.constexpr):
    """The KP largest keys of one vocabulary chunk of one row, in order; with SKIP only for the
    chunks that can hold a top-K entry (at K = 8, 8 of 96 chunks), the others store nothing that
    can win. WRITE_STATS (every chunk runs): also the chunk's max and sum of exponentials, which
    saves the stats launch."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    dst = KEYS + (r * tl.num_programs(1) + c) * KP
    if SKIP:
        run = tl.load(STATS + (r * tl.num_programs(1) + c) * 2) >= tl.load(THR + r)
    else:
        run = True
    if run:
        idx = c * CHUNK + tl.arange(0, CHUNK)
        ok = idx < V
        x = tl.load(X + r * stride_x + idx, mask=ok, other=0.0)
        key = tl.where(ok, _vocab_key(x, idx, V), _INT64_MIN)
        if WRITE_STATS:
            xs = tl.where(ok, x, float("-inf"))
            m = tl.max(xs, 0)
            stats = STATS + (r * tl.num_programs(1) + c) * 2
            tl.store(stats, m)
            tl.store(stats + 1, tl.sum(tl.exp(xs - m), 0))
        if USE_TL_TOPK:
            tl.store(dst + tl.arange(0, KP), tl.topk(key, KP))
        else:
            i = tl.arange(0, CHUNK)
            tl.store(dst + i, tl.sort(key, descending=True), mask=i < KP)
    else:
        tl.store(dst + tl.arange(0, KP), tl.full([KP], _INT64_MIN, tl.int64))


@triton.jit
def _merge_topk_kernel(KEYS, X, STATS, OUT_V, OUT_I, stride_x, V, K, N_CAND, N_CHUNKS, CP: tl.constexpr,
                       KP: tl.constexpr, NC_P2: tl.constexpr, NORMALIZE: tl.constexpr,
                       USE_TL_TOPK: tl.constexpr):
    """The K largest of a row's chunk winners -> values (gathered from X, minus the row's
    logsumexp if NORMALIZE) and token ids."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CP)
    key = tl.load(KEYS + r * N_CAND + j, mask=j < N_CAND, other=_INT64_MIN)
    if USE_TL_TOPK:
        key = tl.topk(key, KP)
        j = tl.arange(0, KP)
    else:
        key = tl.sort(key, descending=True)
    _store_top(key, j, X, STATS, OUT_V, OUT_I, r, stride_x, V, K, N_CHUNKS, NC_P2, NORMALIZE)


@triton.jit
def _store_top(key, j, X, STATS, OUT_V, OUT_I, r, stride_x, V, K, N_CHUNKS, NC_P2: tl.constexpr,
               NORMALIZE: tl.constexpr):
    """Row r's first K of the sorted keys -> values (gathered from X, minus the row's logsumexp
    from its chunk stats if NORMALIZE) and token ids."""
    idx = (V - 1) - (key & 0xFFFFFFFF)
    keep = j < K
    val = tl.load(X + r * stride_x + idx, mask=keep, other=0.0)
    if NORMALIZE:
        c = tl.arange(0, NC_P2)
        m = tl.load(STATS + (r * N_CHUNKS + c) * 2, mask=c < N_CHUNKS, other=float("-inf"))
        s = tl.load(STATS + (r * N_CHUNKS + c) * 2 + 1, mask=c < N_CHUNKS, other=0.0)
        top = tl.max(m, 0)
        val = val - (top + tl.log(tl.sum(s * tl.exp(m - top), 0)))
    tl.store(OUT_V + r * K + j, val, mask=keep)
    tl.store(OUT_I + r * K + j, idx, mask=keep)


@triton.jit
def _ordered(x):
    """fp32 -> int32 with the same order as ``_vocab_key``'s high half (-0.0 == +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _small_chunk_kernel(X, MAXES, STATS, COUNT, stride_x, V, SMALL: tl.constexpr, SEG: tl.constexpr):
    """One small vocabulary chunk of one row: its largest value (as ``_ordered``), and its max and
    sum of exponentials for the logsumexp. Also zeroes the row's candidate count. A chunk is
    SMALL / SEG runs of SEG ids, N_SMALL * SEG apart: a BPE vocabulary keeps its likeliest tokens
    at neighbouring ids, and contiguous chunks holding many of them set a threshold far below
    the k-th value (drafter logits, k = 63: 191 candidates a row on average, 83 interleaved)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    j = tl.arange(0, SMALL)
    idx = (j // SEG) * (tl.num_programs(1) * SEG) + c * SEG + j % SEG
    ok = idx < V
    x = tl.load(X + r * stride_x + idx, mask=ok, other=0.0)
    slot = r * tl.num_programs(1) + c
    tl.store(MAXES + slot, tl.max(tl.where(ok, _ordered(x), -2147483647 - 1), 0))
    xs = tl.where(ok, x, float("-inf"))
    m = tl.max(xs, 0)
    tl.store(STATS + slot * 2, m)
    tl.store(STATS + slot * 2 + 1, tl.sum(tl.exp(xs - m), 0))
    if c == 0:
        tl.store(COUNT + r, 0)


@triton.jit
def _collect_kernel(X, MAXES, COUNT, CAND, stride_x, V, K, N_SMALL, CAP,
                    BIG: tl.constexpr, NS_P2: tl.constexpr, KP: tl.constexpr):
    """The row's threshold is its K-th largest small-chunk max: K chunks reach it, so at least K
    entries do, and every top-K entry is at least the K-th largest value >= it. Each big chunk
    appends the keys of its entries at or above it to the row's candidate list (order free)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    j = tl.arange(0, NS_P2)
    maxes = tl.load(MAXES + r * N_SMALL + j, mask=j < N_SMALL, other=-2147483647 - 1)
    best = tl.topk(maxes, KP)  # descending
    threshold = tl.min(tl.where(tl.arange(0, KP) < K, best, 2147483647), 0)
    idx = c * BIG + tl.arange(0, BIG)
    ok = idx < V
    x = tl.load(X + r * stride_x + idx, mask=ok, other=0.0)
    take = ok & (_ordered(x) >= threshold)
    n = tl.sum(take.to(tl.int32), 0)
    if n > 0:
        base = tl.atomic_add(COUNT + r, n)
        pos = base + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(CAND + r * CAP + pos, _vocab_key(x, idx, V), mask=take & (pos < CAP))


@triton.jit
def _select_kernel(CAND, COUNT, X, STATS, OUT_V, OUT_I, stride_x, V, K, N_SMALL,
                   CAP: tl.constexpr, KP: tl.constexpr, NS_P2: tl.constexpr, NORMALIZE: tl.constexpr,
                   SCAN: tl.constexpr):
    """The K largest candidate keys -> values (minus the logsumexp if NORMALIZE) and ids. A row with
    more candidates than CAP (ties at the threshold) scans its whole row exactly, SCAN at a time."""
    r = tl.program_id(0).to(tl.int64)
    count = tl.load(COUNT + r)
    if count <= CAP:
        j = tl.arange(0, CAP)
        top = tl.topk(tl.load(CAND + r * CAP + j, mask=j < count, other=_INT64_MIN), KP)
    else:
        top = tl.full([KP], _INT64_MIN, tl.int64)
        for c0 in range(0, V, SCAN):
            idx = c0 + tl.arange(0, SCAN)
            ok = idx < V
            x = tl.load(X + r * stride_x + idx, mask=ok, other=0.0)
            chunk = tl.topk(tl.where(ok, _vocab_key(x, idx, V), _INT64_MIN), KP)
            top = tl.topk(tl.reshape(tl.join(top, chunk), [2 * KP]), KP)
    _store_top(top, tl.arange(0, KP), X, STATS, OUT_V, OUT_I, r, stride_x, V, K, N_SMALL, NS_P2, NORMALIZE)


def threshold_plan(vocab: int, k: int, small: int = 256) -> int | None:
    """Small-chunk size for ``topk_threshold_triton``: 256 (fastest at every batch and k in the H200
    sweep, ``topk_threshold_sweep_h200.json``, run before the chunks were interleaved), halved until there are 1.5k chunks, so that the
    k-th largest chunk max stays near the k-th value; None where it cannot run (fewer than k
    chunks, or k = 1 or above 128)."""
    kp = triton.next_power_of_2(k)
    if not 1 < kp <= 128:  # Triton 3.6's tl.topk fails to compile for k = 1
        return None
    while small > 8 and triton.cdiv(vocab, small) * 2 < 3 * k:
        small //= 2
    return small if triton.cdiv(vocab, small) >= k else None


def use_threshold_plan(rows: int, vocab: int, k: int) -> bool:
    """Where the threshold plan beat the chunk plan in the H200 sweep (rows = batch x 15 depths,
    V = 49152, ``topk_threshold_sweep_h200.json``): batch 1 at every k (k = 63: 35.0 -> 11.5 us),
    k >= 15 at batch 4, k >= 31 at any batch (batch 64, k = 31: 390 -> 299 us). At small k and
    many rows the chunk plan sorts fewer entries (only the chunks that can win), and wins."""
    if threshold_plan(vocab, k) is None:
        return False
    return rows <= 16 or (rows <= 64 and k >= 15) or k >= 31


def topk_threshold_triton(logprobs: torch.Tensor, k: int, small: int | None = None, big: int = 2048,
                          cap: int | None = None, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_per_depth`` (1 < k <= 128) in three launches that sort only a few candidates per
    row instead of every chunk's top k: the max of each small (interleaved) chunk, then every entry at or above
    the row's k-th largest chunk max joins the row's candidates (at least k, usually 1-2k), then
    one program per row selects the k best of them. ``cap``: candidates kept per row (default 4x
    k rounded up to a power of two, at least 64; the sweep's rows had at most 1.4k); a row with
    more scans its row exactly instead (slow, rare: ties at the cut)."""
    x = logprobs.float()
    *lead, V = x.shape
    x2 = x.reshape(-1, V)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    small = small or threshold_plan(V, k)
    assert small is not None and triton.cdiv(V, small) >= k, "threshold_plan: this k cannot use it"
    kp = triton.next_power_of_2(k)
    cap = cap or max(64, 4 * kp)
    n_small = triton.cdiv(V, small)
    ns_p2 = max(kp, triton.next_power_of_2(n_small))
    big = min(big, max(small, triton.next_power_of_2(V)))
    maxes = torch.empty(R, n_small, device=x.device, dtype=torch.int32)
    stats = torch.empty(R, n_small, 2, device=x.device, dtype=torch.float32)
    count = torch.empty(R, device=x.device, dtype=torch.int32)
    cand = torch.empty(R, cap, device=x.device, dtype=torch.int64)
    _small_chunk_kernel[(R, n_small)](x2, maxes, stats, count, x2.stride(0), V, SMALL=small, SEG=min(8, small),
                                      num_warps=1 if small <= 256 else 4)
    _collect_kernel[(R, triton.cdiv(V, big))](x2, maxes, count, cand, x2.stride(0), V, k, n_small, cap,
                                              BIG=big, NS_P2=ns_p2, KP=kp, num_warps=4)
    vals = torch.empty(R, k, device=x.device, dtype=torch.float32)
    ids = torch.empty(R, k, device=x.device, dtype=torch.int64)
    _select_kernel[(R,)](cand, count, x2, stats, vals, ids, x2.stride(0), V, k, n_small, CAP=cap, KP=kp,
                         NS_P2=ns_p2, NORMALIZE=normalize, SCAN=max(cap, min(2048, triton.next_power_of_2(V))),
                         num_warps=4)
    return vals.view(*lead, k), ids.view(*lead, k)


def _topk_plan(rows: int, k: int) -> tuple[int, int, int]:
    """(chunk, chunk-kernel warps, merge warps), from sweeps on the H200 at V = 49152
    (bench/results/topk_sweep_h200.json, and with the skip rule topk_skip_sweep_h200.json): small
    chunks once many rows fill the GPU, since then only the k chunks that can win are sorted."""
    if k > 32:
        return (2048, 2, 8) if rows <= 64 else (512, 4, 8)
    return (2048, 8, 8) if rows <= 16 else (512, 4, 8 if rows <= 64 else 4)


def topk_triton(logprobs: torch.Tensor, k: int, chunk: int | None = None,
                warps: tuple[int, int] | None = None,
                use_tl_topk: bool = HAS_TL_TOPK, normalize: bool = False,
                skip: bool = True, method: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_per_depth`` (0 < k < V) in four launches: each chunk's max (and sum of
    exponentials), each row's k-th largest chunk max, then each chunk that can hold a top-k entry
    (max at least that) sorts itself and keeps its k best keys, then one program per row sorts the
    winners (with k >= the chunk count every chunk sorts and the first two launches go). On the
    H200, 960 rows (batch 64 x 15 depths), k = 8: 0.55 -> 0.14 ms (``topk_skip_sweep_h200.json``).
    ``normalize``: the input is logits and the values come back as log-probabilities (the row's
    logsumexp from the chunk sums), so a log-softmax over the whole [rows, V] (0.10 ms for 512
    rows on the H200) is not needed.
    Replaces an int64 radix select over the whole vocabulary (8 passes of 4 kernels, ~70 us on an
    H200 for 15 x 49152 and k = 32). ``chunk``: vocabulary entries per program (a power of two
    >= k; default from the plan); ``warps``: (chunk kernel, merge kernel) warp counts (default
    from the plan); ``skip``: sort only the chunks that can win (off: every chunk, as before).
    ``method``: "chunk" (this), "threshold" (``topk_threshold_triton``), or "auto": the threshold
    plan where ``use_threshold_plan`` says it is faster."""
    if method == "threshold" or (method == "auto" and chunk is None and warps is None
                                 and use_threshold_plan(logprobs.numel() // logprobs.shape[-1],
                                                        logprobs.shape[-1], k)):
        return topk_threshold_triton(logprobs, k, normalize=normalize)
    x = logprobs.float()
    *lead, V = x.shape
    x2 = x.reshape(-1, V)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    kp = triton.next_power_of_2(k)
    use_tl_topk = use_tl_topk and kp > 1  # Triton 3.6's tl.topk fails to compile for k = 1
    plan_chunk, w1, w2 = _topk_plan(R, k)
    w1, w2 = warps or (w1, w2)
    chunk = chunk or max(kp, min(plan_chunk, triton.next_power_of_2(V)))
    chunks = triton.cdiv(V, chunk)
    nc_p2 = max(2, triton.next_power_of_2(chunks))
    skip = skip and k < chunks
    stats = torch.empty(R, chunks, 2, device=x.device, dtype=torch.float32)
    threshold = torch.empty(R, device=x.device, dtype=torch.float32)
    if skip:
        _chunk_stats_kernel[(R, chunks)](x2, stats, x2.stride(0), V, CHUNK=chunk, num_warps=w1)
        _chunk_threshold_kernel[(R,)](stats, threshold, k, chunks, NC_P2=nc_p2, num_warps=1 if nc_p2 <= 128 else 4)
    keys = torch.empty(R, chunks * kp, device=x.device, dtype=torch.int64)
    _chunk_topk_kernel[(R, chunks)](x2, keys, stats, threshold, x2.stride(0), V, CHUNK=chunk, KP=kp,
                                    SKIP=skip, WRITE_STATS=normalize and not skip, USE_TL_TOPK=use_tl_topk,
                                    num_warps=w1)
    vals = torch.empty(R, k, device=x.device, dtype=torch.float32)
    ids = torch.empty(R, k, device=x.device, dtype=torch.int64)
    cp = triton.next_power_of_2(chunks * kp)
    _merge_topk_kernel[(R,)](keys, x2, stats, vals, ids, x2.stride(0), V, k, chunks * kp, chunks, CP=cp, KP=kp,
                             NC_P2=nc_p2, NORMALIZE=normalize, USE_TL_TOPK=use_tl_topk, num_warps=w2)
    return vals.view(*lead, k), ids.view(*lead, k)


_PLANS: dict = {}


def _plan(budget: int, depth: int, vocab: int, device):
    """Static per-(budget, depth, vocab) tables: beam sizes, offsets and candidate pairs."""
    key = (budget, depth, vocab, str(device))
    if key not in _PLANS:
        K = min(budget, vocab)
        sizes = [K]
        for d in range(1, depth):
            sizes.append(max(0, min(budget - d, sizes[-1] * K)))
        offs = [0]
        for s in sizes[:-1]:
            offs.append(offs[-1] + s)
        top = max(sizes[1:], default=0)
        pairs = [(j, r) for j in range(top) for r in range(K) if (j + 1) * (r + 1) <= top]
        cand = triton.next_power_of_2(max(len(pairs), 16))
        pairs += [(budget * K + 1, K)] * (cand - len(pairs))  # never valid
        t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        beam_p2 = min(cand, max(2, triton.next_power_of_2(top)))  # a beam after depth 1, padded
        _PLANS[key] = (K, t(sizes), t(offs), t([j for j, _ in pairs]), t([r for _, r in pairs]),
                       sum(sizes), cand, beam_p2)
    return _PLANS[key]


def build_tree_triton(logprobs: torch.Tensor, budget: int, roots: torch.Tensor,
                      num_warps: int | None = None, normalize: bool = False):
    """``build_tree_batched`` + ``with_root`` + ``ancestor_mask`` in one launch after the top-k:
    logprobs [N, D, V], roots [N] -> full trees (tokens, parents, depths) [N, T] with the root at
    0, and the ancestor mask [N, T, T] (bool), T = B' + 1. ``normalize``: ``logprobs`` are
    logits; the top-k turns the entries it keeps into log-probabilities."""
    N, D, V = logprobs.shape
    device = logprobs.device
    n_nodes = effective_budget(budget, D, V)
    T = n_nodes + 1
    out = [torch.empty(N, T, device=device, dtype=torch.long) for _ in range(3)]
    mask = torch.empty(N, T, T, device=device, dtype=torch.bool)
    if n_nodes == 0:
        out[0].copy_(roots.view(N, 1))
        out[1].zero_()
        out[2].zero_()
        mask.fill_(True)
        return (*out, mask)
    K, sizes, offs, pair_j, pair_r, total, cand, beam_p2 = _plan(budget, D, V, device)
    if 0 < K < V:
        lp, tok = topk_triton(logprobs, K, normalize=normalize)
    else:
        lp, tok = topk_per_depth(torch.log_softmax(logprobs.float(), -1) if normalize else logprobs, K)
    lp = lp.clamp(max=0.0).contiguous()
    tok = tok.contiguous()
    total_p2 = triton.next_power_of_2(total)
    all_score = torch.empty(N, total_p2, device=device, dtype=torch.float32)
    all_tok = torch.empty(N, total_p2, device=device, dtype=torch.long)
    all_par = torch.empty(N, total_p2, device=device, dtype=torch.int32)
    inv = torch.empty(N, total_p2, device=device, dtype=torch.int32)
    t_p2 = triton.next_power_of_2(T)
    sel_p2 = min(total_p2, max(2, triton.next_power_of_2(n_nodes)))
    _build_tree_kernel[(N,)](
        lp, tok, roots.to(torch.long).contiguous(), sizes, offs, pair_j, pair_r, all_score, all_tok,
        all_par, inv, *out, mask.view(torch.int8),
        D=D, K=K, N_NODES=n_nodes, CAND=cand, BEAM_P2=beam_p2, KP2=triton.next_power_of_2(K),
        TOTAL_P2=total_p2, SEL_P2=sel_p2, T_P2=t_p2, MASK_ROWS=max(1, min(t_p2, 8192 // t_p2)),
        MAX_DEPTH=min(D, n_nodes),
        num_warps=num_warps or (4 if total_p2 <= 1024 else 8))
    return (*out, mask)


@triton.jit
def _compact_kv_kernel(KV, PATH, NUM_ACC, SLOTS, plane_stride, stride_path, stride_slots,
                       L: tl.constexpr, L_P2: tl.constexpr, ROW: tl.constexpr, ROW_P2: tl.constexpr):
    """One (sequence, layer-K/V plane): accepted node k moves from slot slots[path[k]] to slots[k]."""
    n = tl.program_id(0).to(tl.int64)
    plane = KV + tl.program_id(1).to(tl.int64) * plane_stride
    k = tl.arange(0, L_P2)
    p = tl.load(PATH + n * stride_path + k, mask=k < L, other=0)
    move = (k < L) & (k < tl.load(NUM_ACC + n)) & (p != k)
    src = tl.load(SLOTS + n * stride_slots + p, mask=move, other=0).to(tl.int64)
    dst = tl.load(SLOTS + n * stride_slots + k, mask=move, other=0).to(tl.int64)
    e = tl.arange(0, ROW_P2)
    m = move[:, None] & (e[None, :] < ROW)
    rows = tl.load(plane + src[:, None] * ROW + e[None, :], mask=m)
    # A destination can be another move's source (path[j] == k for some j < k): every read
    # must land before any write, across the program's warps too.
    tl.debug_barrier()
    tl.store(plane + dst[:, None] * ROW + e[None, :], rows, mask=m)


def compact_kv_triton(kv: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """In place on kv [layers, 2, slots, heads, dim]: for every sequence n and k < num_accepted[n],
    the K/V at slot slots[n, path[n, k]] moves to slots[n, k] (what ``compaction_moves`` plans),
    every layer at once, in one launch instead of ~6 torch kernels."""
    N, L = path.shape
    layers, two, num_slots = kv.shape[:3]
    row = kv[0, 0, 0].numel()
    assert kv.is_contiguous() and path.stride(1) == 1 and slots.stride(1) == 1
    _compact_kv_kernel[(N, layers * two)](
        kv, path, num_accepted.contiguous(), slots, num_slots * row, path.stride(0), slots.stride(0),
        L=L, L_P2=triton.next_power_of_2(L), ROW=row, ROW_P2=triton.next_power_of_2(row), num_warps=4)


@triton.jit
def _accept_walk_kernel(TOK, PAR, DEP, SAMP, PATH, NUM_ACC, BONUS, stride_tok, stride_par, stride_dep, stride_samp,
                        stride_path, T, T_P2: tl.constexpr, L: tl.constexpr, L_P2: tl.constexpr,
                        MAX_DEPTH: tl.constexpr):
    """One sequence: ``accept_walk`` (the parent-pointer form) in registers."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, T_P2)
    valid = i < T
    par = tl.load(PAR + n * stride_par + i, mask=valid, other=0).to(tl.int32)
    tok = tl.load(TOK + n * stride_tok + i, mask=valid, other=-1)
    samp = tl.load(SAMP + n * stride_samp + i, mask=valid, other=-2)
    # Node i matches when its token is what the target sampled at its parent; the root always.
    root = (i == 0).to(tl.int32)
    match = tl.maximum((valid & (tok == tl.gather(samp, par, 0))).to(tl.int32), root)
    alive = root
    for _ in range(MAX_DEPTH):  # alive: it and every ancestor below the root match
        alive = tl.maximum(root, match * tl.gather(alive, par, 0))
    dep = tl.load(DEP + n * stride_dep + i, mask=valid, other=0)
    alive_depth = tl.where((alive > 0) & valid, dep, -1)
    last_depth = tl.max(alive_depth, 0)
    last = tl.min(tl.where(alive_depth == last_depth, i, T_P2), 0)  # one alive node per depth
    # Path: node k is last_depth - k parent steps above the last node (past the end: the last).
    k = tl.arange(0, L_P2)
    up = tl.maximum(last_depth - k, 0)
    cur = tl.zeros([L_P2], tl.int32) + last
    for s in range(MAX_DEPTH):
        cur = tl.where(up > s, tl.gather(par, cur, 0), cur)
    tl.store(PATH + n * stride_path + k, cur.to(tl.int64), mask=k < L)
    tl.store(NUM_ACC + n, (last_depth + 1).to(tl.int64))
    tl.store(BONUS + n, tl.load(SAMP + n * stride_samp + last))


def accept_walk_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, samples: torch.Tensor,
                       max_depth: int):
    """``ddtree.tree.accept_walk`` in one launch: (path [N, max_depth+1], num_accepted [N], bonus [N])."""
    N, T = tokens.shape
    L = max_depth + 1
    path = torch.empty(N, L, dtype=torch.long, device=tokens.device)
    num_accepted = torch.empty(N, dtype=torch.long, device=tokens.device)
    bonus = torch.empty(N, dtype=samples.dtype, device=tokens.device)
    for x in (tokens, parents, depths, samples):
        assert x.stride(1) == 1, "rows must be contiguous"
    t_p2 = triton.next_power_of_2(T)
    _accept_walk_kernel[(N,)](
        tokens, parents, depths, samples, path, num_accepted, bonus, tokens.stride(0), parents.stride(0),
        depths.stride(0), samples.stride(0), path.stride(0), T, T_P2=t_p2, L=L, L_P2=triton.next_power_of_2(L),
        MAX_DEPTH=max_depth, num_warps=1 if t_p2 <= 128 else 4)
    return path, num_accepted, bonus
