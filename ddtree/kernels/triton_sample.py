"""One sample per row of fp32 logits in one launch. The engine's CUDA path for unfiltered sampling
until the fused LM head (``triton_lm_head``) took its place, which writes no logits; kept as that
kernel's two-pass baseline in ``scripts/device/profile_lm_head.py``. The Gumbel-max trick, argmax(logits / T + G) with G = -log(-log U) drawn by
Triton's Philox from a seed the graph reads from the device, is a draw from softmax(logits / T).
It replaces the torch path (temperature, softmax, exponential race, division, argmax over
[N, T, V]): a T = 1 round's accept stage (sampling + walk) went from 0.081 to 0.053 ms for plain
decoding at batch 1 and from 1.82 to 0.54 ms for a 32-node tree at batch 64 on the H200 (the
bench's per-stage split).

The first version (one program per row, one ``tl.rand`` per entry) took 46 / 187 / 325 us for
64 / 576 / 1088 rows at V = 49152 on the H200: a full Philox call per entry, of which three of
its four outputs were thrown away, dominated, and 64 rows ran as 64 programs on 132 SMs. Now:

- One ``tl.randint4x`` per four entries. Row r's vocabulary is cut into four quarters of
  Q = ceil(V / 4); entry k * Q + j takes output k of Philox counter r * Q + j, so every
  (row, entry) has its own uniform whatever the block size or split.
- With few rows a row's blocks are split over several programs (rows * splits ~ 4 per SM), each
  writing its best as an int64 key (score, then the smaller index); a small second kernel takes
  each row's largest key. With 4 rows per SM or more (528 on the H200) a program keeps a whole
  row and writes the index.
- Greedy rows skip the random numbers.

On the H200 (one eager round each, `scripts/device/profile_batch.py`,
`bench/results/profile_batch_n64_h200.json`): 46 -> 14 us for 64 rows, 187 -> 112 us for 576,
292 -> 171 us for 1088.

Rows of requests with temperature <= 0 take the first maximal logit, as ``torch.argmax`` does
(an all -inf row gives 0); NaN scores never win.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels import sm_count
from ddtree.kernels.triton_tree import _INT64_MIN, _vocab_key

_PROGRAMS_PER_SM = 4  # 528 programs on the H200's 132 SMs
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _take(x_row, idx, bits, inv_temp, best, arg, V, GUMBEL: tl.constexpr):
    ok = idx < V
    x = tl.load(x_row + idx, mask=ok, other=float("-inf"))
    if GUMBEL:
        # tl.random.uint_to_uniform_float inlined (fewer calls in the interpreter): U in [0, 1);
        # U = 0 gives G = -inf, which never wins; the scale keeps U = 1 out after rounding
        b = bits.to(tl.int32, bitcast=True)
        u = tl.where(b < 0, ~b, b) * 4.6566127342e-10
        s = x * inv_temp - tl.log(-tl.log(u))
    else:
        s = x
    # strict: a lane sees its indices in increasing order, so it keeps the first of a tie
    take = ok & (s > best)
    return tl.where(take, s, best), tl.where(take, idx, arg)


@triton.jit
def _scan(x_row, seed, ctr, inv_temp, b0, b1, V, Q, BQ: tl.constexpr, GUMBEL: tl.constexpr):
    """Best (score, first index) over quarter-blocks [b0, b1) of one row."""
    j = tl.arange(0, BQ)
    best0 = tl.full([BQ], float("-inf"), tl.float32)
    best1 = best0
    best2 = best0
    best3 = best0
    arg0 = tl.full([BQ], _NO_INDEX, tl.int32)
    arg1 = arg0
    arg2 = arg0
    arg3 = arg0
    for b in range(b0, b1):
        jj = b * BQ + j
        if GUMBEL:
            r0, r1, r2, r3 = tl.randint4x(seed, ctr + jj)
        else:
            r0, r1, r2, r3 = jj, jj, jj, jj  # unused
        best0, arg0 = _take(x_row, jj, r0, inv_temp, best0, arg0, V, GUMBEL)
        best1, arg1 = _take(x_row, jj + Q, r1, inv_temp, best1, arg1, V, GUMBEL)
        best2, arg2 = _take(x_row, jj + 2 * Q, r2, inv_temp, best2, arg2, V, GUMBEL)
        best3, arg3 = _take(x_row, jj + 3 * Q, r3, inv_temp, best3, arg3, V, GUMBEL)
    m = tl.maximum(tl.maximum(tl.max(best0, 0), tl.max(best1, 0)),
                   tl.maximum(tl.max(best2, 0), tl.max(best3, 0)))
    # lanes do not follow index order: the smallest index among the lanes holding the max
    i = tl.minimum(tl.minimum(tl.min(tl.where(best0 == m, arg0, _NO_INDEX), 0),
                              tl.min(tl.where(best1 == m, arg1, _NO_INDEX), 0)),
                   tl.minimum(tl.min(tl.where(best2 == m, arg2, _NO_INDEX), 0),
                              tl.min(tl.where(best3 == m, arg3, _NO_INDEX), 0)))
    # nothing beat -inf: the range's first index, so an all -inf row gives 0 as torch.argmax does
    i = tl.where(i == _NO_INDEX, b0 * BQ, i)
    return m, i


@triton.jit
def _gumbel_argmax_kernel(LOGITS, TEMP, SEED, OUT, KEYS, V, T, Q, N_BLOCKS, PER_SPLIT,
                          BQ: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(TEMP + row // T)
    x_row = LOGITS + row * V
    b0 = split * PER_SPLIT
    b1 = tl.minimum(b0 + PER_SPLIT, N_BLOCKS)
    if temp <= 0:
        m, i = _scan(x_row, 0, 0, 1.0, b0, b1, V, Q, BQ, False)
    else:
        m, i = _scan(x_row, tl.load(SEED), row * Q, 1.0 / temp, b0, b1, V, Q, BQ, True)
    if SPLIT:
        tl.store(KEYS + row * tl.num_programs(1) + split, _vocab_key(m, i, V))
    else:
        tl.store(OUT + row, i.to(tl.int64))


@triton.jit
def _first_max_kernel(KEYS, OUT, ROWS, V, SPLITS, RB: tl.constexpr, SP: tl.constexpr):
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    s = tl.arange(0, SP)
    ok = r < ROWS
    key = tl.load(KEYS + r[:, None] * SPLITS + s[None, :], mask=ok[:, None] & (s[None, :] < SPLITS),
                  other=_INT64_MIN)
    tl.store(OUT + r, (V - 1) - (tl.max(key, 1) & 0xFFFFFFFF), mask=ok)


def sample_gumbel_triton(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                         block: int = 2048, splits: int | None = None) -> torch.Tensor:
    """logits [N, T, V] fp32, temperature [N], seed: int64 [1] on the device (advanced by one
    here, on the stream, so every replay of a captured graph draws fresh numbers) -> [N, T] int64.
    ``block`` entries (a power of two >= 4) per step; ``splits`` programs per row (default: enough
    to give the GPU ~4 programs per SM, capped by the row's blocks)."""
    N, T, V = logits.shape
    rows = N * T
    x = logits.float().contiguous()
    out = torch.empty(N, T, dtype=torch.long, device=logits.device)
    quarter = triton.cdiv(V, 4)
    bq = max(1, min(block // 4, triton.next_power_of_2(quarter)))
    n_blocks = triton.cdiv(quarter, bq)
    if splits is None:
        splits = triton.cdiv(_PROGRAMS_PER_SM * sm_count(logits.device), max(rows, 1))
    per_split = triton.cdiv(n_blocks, max(1, min(splits, n_blocks)))
    splits = triton.cdiv(n_blocks, per_split)  # no empty splits
    keys = torch.empty(rows, splits, dtype=torch.long, device=logits.device) if splits > 1 else out
    _gumbel_argmax_kernel[(rows, splits)](x, temperature.float().contiguous(), seed, out, keys, V, T,
                                          quarter, n_blocks, per_split, BQ=bq, SPLIT=splits > 1,
                                          num_warps=8 if bq >= 512 else 4)
    if splits > 1:
        rb = 64
        _first_max_kernel[(triton.cdiv(rows, rb),)](keys, out, rows, V, splits, RB=rb,
                                                    SP=triton.next_power_of_2(splits), num_warps=4)
    seed.add_(1)
    return out
