"""The vLLM plugin's GPU tree attention and K/V moves, on vLLM's GPU cache layout, without vLLM.

vLLM's FlashAttention and Triton backends hand each layer a logical [blocks, kv_heads, block_size,
2 * head] cache (key = channels :head, value = head:) whose physical stride order depends on the
KV cache layout setting. These functions are pure torch, so they run here on CPU and, on a CUDA
machine, on the GPU; the reference is float64 dense attention.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddtree.vllm.attention import StepMasks, gpu_tree_forward, move_tokens_logical

from paged_case import LENGTHS, check_against_reference, paged_case

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Physical orders of the logical axes (blocks, heads, tokens, channels): vLLM's HND-like order,
# NHD-like (heads inside tokens) and heads outermost (blocks not the slowest axis).
ORDERS = {"BHNC": (0, 1, 2, 3), "BNHC": (0, 2, 1, 3), "HBNC": (1, 0, 2, 3)}


def logical_cache(order, num_blocks, kv_heads, block_size, head, dtype, device):
    shape = (num_blocks, kv_heads, block_size, 2 * head)
    physical = torch.zeros([shape[i] for i in order], dtype=dtype, device=device)
    inverse = [order.index(i) for i in range(4)]
    cache = physical.permute(*inverse)
    assert cache.shape == shape
    return cache


def write(cache, slots, k, v):
    block_size, head = cache.shape[2], cache.shape[3] // 2
    cache[slots // block_size, :, slots % block_size, :head] = k
    cache[slots // block_size, :, slots % block_size, head:] = v


# Every layout in fp32 and, on CUDA, in bf16; bf16 on the CPU once.
CASES = [(d, o, torch.float32) for d in DEVICES for o in ORDERS] + [("cpu", "BHNC", torch.bfloat16)] + \
    [("cuda", o, torch.bfloat16) for o in ORDERS if "cuda" in DEVICES]


@pytest.mark.parametrize("device,order,dtype", CASES)
def test_gpu_tree_attention_equals_float64_reference(device, order, dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head, block_size, num_blocks = 6, 2, 64, 16, 64
    cache = logical_cache(ORDERS[order], num_blocks, kv_heads, block_size, head, dtype, device)
    masks, starts, table, keys, values = paged_case(
        num_blocks, block_size, kv_heads, head, lambda slots, k, v: write(cache, slots.to(device), k.to(device),
                                                                         v.to(device)), g, dtype)
    T = starts[-1]
    query = torch.randn(T + 3, heads, head, generator=g).to(dtype)  # 3 padding rows, as vLLM pads
    meta = SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                           seq_lens=torch.tensor(LENGTHS, dtype=torch.int32, device=device),
                           block_table=table.to(device), num_actual_tokens=T)
    impl = SimpleNamespace(scale=0.125, sliding_window=(-1, -1), alibi_slopes=None, sinks=None,
                           logits_soft_cap=0.0, kv_cache_dtype="auto")
    output = torch.full((T + 3, heads * head), float("nan"), dtype=dtype, device=device)
    gpu_tree_forward(impl, query.to(device), cache, meta, output, StepMasks(masks, frozenset()))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    check_against_reference(output[:T].view(T, heads, head), query, masks, starts, keys, values, 0.125, tol)
    assert bool(torch.isnan(output[T:]).all()), "padding rows must stay untouched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", list(ORDERS))
def test_move_tokens_logical_moves_exactly_the_named_slots(device, order):
    cache = logical_cache(ORDERS[order], 6, 2, 8, 4, torch.float32, device)
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape))
    before = cache.clone()
    src = torch.tensor([9, 10, 30], device=device)  # block 1 -> block 3, block 3 -> block 0
    dst = torch.tensor([26, 27, 2], device=device)
    move_tokens_logical(cache, src, dst)
    want = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[d // 8, :, d % 8] = before[s // 8, :, s % 8]
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    assert not torch.equal(cache, before)


def test_gpu_tree_attention_refuses_other_attention_kinds():
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
                           block_table=torch.zeros(1, 1, dtype=torch.int32), num_actual_tokens=1)
    plain = dict(scale=1.0, sliding_window=(-1, -1), alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                 kv_cache_dtype="auto")
    for bad in [dict(sliding_window=(127, 0)), dict(alibi_slopes=torch.ones(2)), dict(sinks=torch.ones(2)),
                dict(logits_soft_cap=30.0), dict(kv_cache_dtype="fp8")]:
        with pytest.raises(ValueError, match="plain causal attention only"):
            gpu_tree_forward(SimpleNamespace(**{**plain, **bad}), torch.zeros(1, 2, 4),
                             torch.zeros(1, 2, 4, 8), meta, torch.zeros(1, 8), StepMasks([None], frozenset()))
