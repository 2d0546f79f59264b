"""The target's LM head with the round's sampling in its epilogue: hidden [M, H] x W [V, H]^T ->
one token per row, without writing the [M, V] fp32 logits (403 MB for a 32-node tree at batch 64
and V = 49152) or reading them back in a separate argmax / sampling pass.

Two launches:

1. ``_lm_head_kernel``: a [BM, BN] tile of logits per program. It keeps, per row, the best
   (score, first index) as an int64 key (score = logit / T for sampled rows, the logit for greedy
   ones) and, when sampling, the sum of exp(score - tile max) over each group of 16 columns and
   over the whole tile.
2. ``_pick_kernel``, one program per row: a greedy row (T <= 0) takes its best key, i.e. the
   first maximal logit, as ``torch.argmax`` does. A sampled row inverts the CDF of softmax(logits
   / T) with one uniform u: a float64 scan over the V / BN tile weights picks the tile whose
   cumulative weight first exceeds u * Z (float64, so a rare token's interval is not lost to fp32
   rounding near Z), a scan over that tile's BN / 16 group weights the group, and the group's 16
   logits are recomputed (16 x H multiply-adds) to pick the token. (One scan over all V / 16
   group weights took 113 us at 4,096 rows, ``profile_lm_head_epilogues_h200.json``.)

Rejected epilogues (``bench/results/profile_lm_head_epilogues_h200.json``, a variant kernel
measured and removed): the tile's best as an int64 max over per-entry keys (4,096 rows: 532
against 477 us greedy, 740 against 662 sampled; the best is now an fp32 max, then its first
column), and the group sums as three tensor-core dots of bf16 slices of the exponentials against a
0/1 group indicator (exact, but 870 against 662 us sampled).

On the H200 at the SmolLM2 shape (H = 576, V = 49152, bf16; ``scripts/device/profile_lm_head.py``),
against cuBLAS into fp32 logits then argmax / ``sample_gumbel_triton``
(``bench/results/profile_lm_head_h200.json``, the first version): 2,048 rows 345 -> 282 us greedy,
545 -> 379 us sampled; 4,096 rows 690 -> 542 / 1,093 -> 735 us; one row 27.9 -> 18.8 us greedy,
but 24.2 -> 26.4 us sampled. Now (``profile_lm_head_split_h200.json``; a bare cuBLAS GEMM
into fp32 takes 218 / 470 us): 2,048 rows 253 us greedy, 308 sampled (tiles 285, pick 22);
4,096 rows 488 / 614 (565 + 37); one row 18.5 / 26.5.
Why not the Gumbel-max trick in the epilogue: one uniform per vocabulary entry, and the Philox
draws cost more than the GEMM (2,048 rows: 646 us;
``bench/results/profile_lm_head_gumbel_epilogue_rejected_h200.json``).
Rounding: group weights are fp32 sums of fp32 exponentials (tile weights fp32 sums of those),
and the picked group's logits are recomputed in another summation order, so probabilities carry
~1e-7 relative error (as any fp32 sampler's); the token picked is always one with nonzero weight.
NaN logits never win and have weight 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.triton_tree import _INT64_MIN, _vocab_key

GROUP = 16  # columns per stored weight: 16 x H recomputed per sampled row, M x V / 16 sums written


@triton.jit
def _key_value(key):
    """The fp32 score in a ``_vocab_key``'s high half (the inverse of its order map)."""
    hi = (key >> 32).to(tl.int32)
    return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)


@triton.jit
def _lm_head_kernel(H, W, TEMP, KEYS, SUMS, TILE_SUMS, M, V, K, T, N_TILES, N_GROUPS, stride_h, stride_w,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                    SAMPLE: tl.constexpr, IEEE: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < V
    kk = tl.arange(0, BK)
    h_ptr = H + rows.to(tl.int64)[:, None] * stride_h + kk[None, :]
    w_ptr = W + cols.to(tl.int64)[:, None] * stride_w + kk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + kk) < K
        h = tl.load(h_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:  # fp32 weights: exact fp32 products, not TF32
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)

    ok = row_ok[:, None] & col_ok[None, :]
    score = acc
    if SAMPLE:
        temp = tl.load(TEMP + rows // T, mask=row_ok, other=0.0)
        score = acc * (1.0 / tl.where(temp > 0, temp, 1.0))[:, None]
    score = tl.where(ok & (score == score), score, float("-inf"))  # NaN never wins
    # The tile's best as an fp32 max, then its first column: 11 % faster at 4,096 rows than an
    # int64 max over per-entry keys (profile_lm_head_epilogues_h200.json).
    top = tl.max(score, 1)
    first = tl.min(tl.where(score == top[:, None], cols[None, :], V), 1)
    tl.store(KEYS + rows.to(tl.int64) * N_TILES + pn, _vocab_key(top, first, V), mask=row_ok)
    if SAMPLE:
        e = tl.exp(score - tl.where(top > float("-inf"), top, 0.0)[:, None])
        sums = tl.sum(tl.reshape(e, [BM, BN // G, G]), 2)
        g = pn * (BN // G) + tl.arange(0, BN // G)
        tl.store(SUMS + rows.to(tl.int64)[:, None] * N_GROUPS + g[None, :], sums,
                 mask=row_ok[:, None] & (g[None, :] < N_GROUPS))
        tl.store(TILE_SUMS + rows.to(tl.int64) * N_TILES + pn, tl.sum(sums, 1), mask=row_ok)


@triton.jit
def _pick_kernel(KEYS, SUMS, TILE_SUMS, H, W, TEMP, SEED, OUT, V, K, T, N_TILES, N_GROUPS,
                 stride_h, stride_w, TILES_P2: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
                 GPT_P2: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, SAMPLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, TILES_P2)
    t_ok = t < N_TILES
    keys = tl.load(KEYS + row * N_TILES + t, mask=t_ok, other=_INT64_MIN)
    best = tl.max(keys, 0)
    token = (V - 1) - (best & 0xFFFFFFFF)
    top = _key_value(best)
    if SAMPLE:
        temp = tl.load(TEMP + row // T)
        if (temp > 0) & (top > float("-inf")):
            r0, r1, _, _ = tl.randint4x(tl.load(SEED), row)
            u = r0.to(tl.uint32).to(tl.float64) * 2.3283064365386963e-10 \
                + r1.to(tl.uint32).to(tl.float64) * 5.421010862427522e-20  # [0, 1), 64 random bits
            # the tile: a float64 scan over the tiles' weights (sum * exp(tile max - row max))
            scale = tl.exp(_key_value(keys) - top).to(tl.float64)
            ts = tl.load(TILE_SUMS + row * N_TILES + t, mask=t_ok, other=0.0)
            w = tl.where(t_ok & (ts > 0), ts.to(tl.float64) * scale, 0.0)
            cum = tl.cumsum(w, 0)
            target = u * tl.max(cum, 0)
            last = tl.max(tl.where(w > 0, t, -1), 0)  # rounding never picks a weightless tile
            tile = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), last)
            rest = target - tl.max(tl.where(t < tile, cum, 0.0), 0)
            # the group inside it (the tile total is the fp32 sum of these, so rest can overshoot
            # their scan by rounding: the last weighted group then takes it)
            j = tl.arange(0, GPT_P2)
            g = tile * GROUPS_PER_TILE + j
            g_ok = (j < GROUPS_PER_TILE) & (g < N_GROUPS)
            s = tl.load(SUMS + row * N_GROUPS + g, mask=g_ok, other=0.0)
            tile_scale = tl.max(tl.where(t == tile, scale, 0.0), 0)
            wg = tl.where(g_ok & (s > 0), s.to(tl.float64) * tile_scale, 0.0)
            cg = tl.cumsum(wg, 0)
            inner = tl.minimum(tl.sum((cg <= rest).to(tl.int32), 0), tl.max(tl.where(wg > 0, j, -1), 0))
            rest = rest - tl.max(tl.where(j < inner, cg, 0.0), 0)
            pick = tile * GROUPS_PER_TILE + inner
            # the picked group's logits again (fp32), in the row's units: exp(logit / T - top)
            c = pick * G + tl.arange(0, G)
            c_ok = c < V
            kk = tl.arange(0, BK)
            acc = tl.zeros([G], tl.float32)
            for k0 in range(0, K, BK):
                k_ok = (k0 + kk) < K
                h = tl.load(H + row * stride_h + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
                wt = tl.load(W + c.to(tl.int64)[:, None] * stride_w + k0 + kk[None, :],
                             mask=c_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(wt * h[None, :], 1)
            x = acc * (1.0 / temp) - top  # as the GEMM's epilogue scales
            p = tl.where(c_ok & (x == x), tl.exp(x).to(tl.float64), 0.0)
            i = tl.arange(0, G)
            inside = tl.minimum(tl.sum((tl.cumsum(p, 0) <= rest).to(tl.int32), 0),
                                tl.max(tl.where(p > 0, i, -1), 0))
            # (all 16 underflowed to 0 after recomputing: the group's first entry)
            token = (pick * G + tl.maximum(inside, 0)).to(tl.int64)
    tl.store(OUT + row, token.to(tl.int64))


# (rows up to, (BM, BN, BK, warps, stages)) for bf16/fp16 (``scripts/device/profile_lm_head.py``);
# fp32 (a check mode: FMA dots) takes small tiles whatever the rows.
_PLANS = ((32, (16, 256, 64, 4, 3)), (64, (64, 128, 64, 4, 3)), (128, (128, 128, 64, 8, 3)),
          (None, (128, 256, 64, 8, 3)))
_FP32_PLAN = (32, 64, 32, 4, 2)


def lm_head_plan(rows: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    if dtype == torch.float32:
        return _FP32_PLAN
    return next(plan for limit, plan in _PLANS if limit is None or rows <= limit)


def lm_head_sample_triton(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor,
                          seed: torch.Tensor, rows_per_seq: int, sampling: bool,
                          plan: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """hidden [M, H] (M = N * rows_per_seq), weight [V, H] (same dtype), temperature [N] -> [M]
    int64 tokens: a draw from softmax(logits / T) for rows with T > 0 (``sampling`` must then be
    true), the first argmax of the logits for T <= 0. ``seed`` (int64 [1] on the device) is
    advanced by one when ``sampling``, on the stream, so each replay of a graph draws afresh."""
    plan = plan or lm_head_plan(hidden.shape[0], hidden.dtype)
    tiles = lm_head_tiles(hidden, weight, temperature, rows_per_seq, sampling, plan)
    return lm_head_pick(tiles, hidden, weight, temperature, seed, rows_per_seq, sampling, plan)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def lm_head_tiles(hidden, weight, temperature, rows_per_seq: int, sampling: bool, plan):
    """The first launch -> (each tile's best key [M, V / BN], and when sampling the group sums
    [M, V / 16] and the tile sums [M, V / BN]; else the keys again in their place)."""
    M, Hd = hidden.shape
    V = weight.shape[0]
    assert weight.shape[1] == Hd and hidden.dtype == weight.dtype
    hidden, weight = _row_major(hidden), _row_major(weight)
    BM, BN, BK, warps, stages = plan
    assert BN % GROUP == 0
    n_tiles, n_groups = triton.cdiv(V, BN), triton.cdiv(V, GROUP)
    keys = torch.empty(M, n_tiles, dtype=torch.long, device=hidden.device)
    sums, tile_sums = keys, keys
    if sampling:
        sums = torch.empty(M, n_groups, dtype=torch.float32, device=hidden.device)
        tile_sums = torch.empty(M, n_tiles, dtype=torch.float32, device=hidden.device)
    _lm_head_kernel[(triton.cdiv(M, BM), n_tiles)](
        hidden, weight, temperature.float().contiguous(), keys, sums, tile_sums, M, V, Hd,
        rows_per_seq, n_tiles, n_groups, hidden.stride(0), weight.stride(0), BM=BM, BN=BN, BK=BK,
        G=GROUP, SAMPLE=sampling, IEEE=hidden.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
    return keys, sums, tile_sums


def lm_head_pick(tiles, hidden, weight, temperature, seed, rows_per_seq: int, sampling: bool,
                 plan) -> torch.Tensor:
    """The second launch: one token per row from ``lm_head_tiles``' output."""
    keys, sums, tile_sums = tiles
    M, Hd = hidden.shape
    V = weight.shape[0]
    hidden, weight = _row_major(hidden), _row_major(weight)
    groups_per_tile = plan[1] // GROUP
    n_tiles, n_groups = triton.cdiv(V, plan[1]), triton.cdiv(V, GROUP)
    out = torch.empty(M, dtype=torch.long, device=hidden.device)
    _pick_kernel[(M,)](keys, sums, tile_sums, hidden, weight, temperature.float().contiguous(), seed,
                       out, V, Hd, rows_per_seq, n_tiles, n_groups, hidden.stride(0), weight.stride(0),
                       TILES_P2=triton.next_power_of_2(n_tiles), GROUPS_PER_TILE=groups_per_tile,
                       GPT_P2=max(2, triton.next_power_of_2(groups_per_tile)), G=GROUP, BK=64,
                       SAMPLE=sampling, num_warps=4 if sampling else 1)
    if sampling:
        seed.add_(1)
    return out
