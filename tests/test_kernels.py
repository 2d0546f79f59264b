"""Attention and fused-layer kernels against float64 / torch references.

On a machine without CUDA the Triton kernels run in Triton's interpreter (numpy), so CI checks
the same kernel code the GPU runs; on CUDA they are compiled and bf16 is checked too."""
import contextlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Without CUDA the kernels run in Triton's interpreter, which must be switched on before triton
# is first imported; other test modules import it (through transformers), so on CPU this module
# re-runs itself in a fresh process with TRITON_INTERPRET=1 (the test at the bottom).
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRETED),
                                   reason="run by test_kernels_under_triton_interpreter in a fresh process")
triton = pytest.importorskip("triton", reason="triton is installed by scripts/setup")

from ddtree.context import AttentionContext  # noqa: E402
from ddtree.kernels.attention import reference_attention  # noqa: E402
from ddtree.kernels.triton_attention import tree_attention  # noqa: E402
from ddtree.tree import ancestor_mask  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
PAGE = 4


def random_parents(gen, n: int) -> list[int]:
    """A random tree over nodes 0..n-1 in topological order (root 0)."""
    return [0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def make_case(gen, cached: list[int], new: int | list[int], mask: str, heads=6, kv_heads=2, dim=16,
              dtype=torch.float32):
    """A paged cache with shuffled blocks holding random K/V; returns (q, k_cache, v_cache, ctx)."""
    N = len(cached)
    new_lens = new if isinstance(new, list) else [new] * N
    blocks_per_seq = [-(-(c + n) // PAGE) for c, n in zip(cached, new_lens)]
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=gen).tolist()  # a few unused blocks
    width = max(blocks_per_seq)
    tables, used = [], 0
    for b in blocks_per_seq:
        tables.append(order[used:used + b] + [0] * (width - b))
        used += b
    num_slots = (len(order)) * PAGE
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(sum(new_lens), heads, dim, generator=gen).to(dtype)
    tree_mask = None
    if mask == "tree":
        T = max(new_lens)
        parents = torch.tensor([random_parents(gen, T) for _ in range(N)])
        tree_mask = ancestor_mask(parents, T - 1).to(DEVICE)
    tables = torch.tensor(tables, device=DEVICE)
    ctx = AttentionContext.build(tables, cached, new_lens, PAGE, mask=mask, tree_mask=tree_mask)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), ctx


def float64_attention(q, k_cache, v_cache, ctx: AttentionContext, scale: float) -> torch.Tensor:
    """Straight from the definition, one sequence and query at a time, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    H, kv_heads = q.shape[1], k_cache.shape[1]
    starts = ctx.query_start.tolist()
    for i in range(ctx.num_seqs):
        c, n = int(ctx.cached_lens[i]), starts[i + 1] - starts[i]
        pos = torch.arange(c + n)
        page = ctx.block_size
        slots = ctx.block_tables[i].cpu()[pos // page] * page + pos % page
        k = k_cache.cpu()[slots].double()
        v = v_cache.cpu()[slots].double()
        for j in range(n):
            if ctx.mask == "causal":
                new_ok = torch.arange(n) <= j
            elif ctx.mask == "full":
                new_ok = torch.ones(n, dtype=torch.bool)
            else:
                new_ok = ctx.tree_mask[i, j, :n].cpu()
            visible = torch.cat([torch.ones(c, dtype=torch.bool), new_ok])
            for h in range(H):
                kh = h // (H // kv_heads)
                s = (k[:, kh] @ q[starts[i] + j, h].cpu().double()) * scale
                s = s.masked_fill(~visible, float("-inf"))
                out[starts[i] + j, h] = torch.softmax(s, 0) @ v[:, kh]
    return out


CASES = [
    ("decode", [5, 0, 17], 1, "causal"),
    ("prefill chunks", [0, 7, 3], [9, 4, 1], "causal"),
    ("drafter block", [6, 1, 20], 5, "full"),
    ("tree verify", [3, 11, 0, 30], 9, "tree"),
    ("big tree", [40, 2], 33, "tree"),
]


@needs_kernels
@pytest.mark.parametrize("name,cached,new,mask", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("splits", [1, 4])
def test_tree_attention_matches_float64(name, cached, new, mask, group, splits):
    """splits=4: keys in 4 ranges merged by log-sum-exp (some ranges empty for short sequences)."""
    gen = torch.Generator().manual_seed(len(name) * 7 + group)
    q, k, v, ctx = make_case(gen, cached, new, mask, heads=2 * group, kv_heads=2)
    scale = 0.25
    want = float64_attention(q, k, v, ctx, scale)
    got = tree_attention(q, k, v, ctx, scale, splits=splits).cpu().double()
    ref = reference_attention(q, k, v, ctx, scale).cpu().double()
    assert (got - want).abs().max() < 1e-5
    assert (ref - want).abs().max() < 1e-5


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (15, 3), (8, 2), (7, 7)])
def test_batched_trees_in_several_query_tiles(heads, kv_heads):
    """Eight 33-node trees with 9 heads over 3 KV heads: each sequence takes several query tiles.
    On the H200 a layout of 3 rows per query (two 21-query tiles) got the first two queries of
    most sequences wrong (the interpreter was exact), and greedy batched DDTree diverged from AR."""
    gen = torch.Generator().manual_seed(heads)
    q, k, v, ctx = make_case(gen, [150, 300, 90, 250, 120, 60, 330, 210], 33, "tree", heads=heads,
                             kv_heads=kv_heads, dim=64)
    want = reference_attention(q, k, v, ctx, 0.125)
    for splits in (1, 2):
        got = tree_attention(q, k, v, ctx, 0.125, splits=splits)
        assert (got - want).abs().max() < 1e-4


@needs_kernels
@pytest.mark.parametrize("new,mask", [(1, "causal"), (9, "tree"), (5, "full")])
def test_launch_plans_agree(new, mask):
    """The plans a launch may take give the float64 result: whole tiles of cached keys without
    the mask (the default with more than one query) or all keys under it, 3 rows per query (9
    heads over 3 KV heads) or 4 (padded, as small grids on the GPU run, also in 32-row programs),
    with and without splits."""
    gen = torch.Generator().manual_seed(new)
    q, k, v, ctx = make_case(gen, [150, 64, 5, 200], new, mask, heads=9, kv_heads=3, dim=64)
    want = float64_attention(q, k, v, ctx, 0.125)
    for splits in (1, 2):
        for rows, block_m in ((3, None), (4, None), (4, 32)):
            for tiles in (True, False):
                got = tree_attention(q, k, v, ctx, 0.125, splits=splits, rows_per_query=rows, block_m=block_m,
                                     unmasked_tiles=tiles)
                assert (got.cpu().double() - want).abs().max() < 1e-5, (splits, rows, block_m, tiles)


def test_launch_plan_pads_the_group_only_for_small_grids(monkeypatch):
    """3 heads per KV head take 3 rows per query in 16- or 64-row programs; when the grid is
    small enough for 8+ key splits the group is padded to 4 rows and 32-row programs return."""
    from ddtree.kernels import triton_attention as ta
    q, k = torch.zeros(5, 9, 64), torch.zeros(8, 3, 64)
    ctx = AttentionContext.uniform(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), 5, PAGE, 20)
    monkeypatch.setattr(ta, "kv_splits_for", lambda *a: 1)
    assert ta.launch_plan(q, k, ctx) == (3, 16, 1, 1, True)
    monkeypatch.setattr(ta, "kv_splits_for", lambda *a: 8)
    assert ta.launch_plan(q, k, ctx) == (4, 32, 1, 8, False)
    ctx.max_queries = 33  # 99 rows: two 64-row tiles of 21 queries, or three of 16 padded
    monkeypatch.setattr(ta, "kv_splits_for", lambda *a: 2)
    assert ta.launch_plan(q, k, ctx) == (3, 64, 2, 2, True)
    monkeypatch.setattr(ta, "kv_splits_for", lambda *a: 16)
    assert ta.launch_plan(q, k, ctx) == (4, 64, 3, 16, False)


@needs_kernels
@pytest.mark.skipif(not CUDA, reason="bf16 tree attention is checked on the GPU (numpy has no bf16)")
def test_tree_attention_bf16_close_to_float64():
    gen = torch.Generator().manual_seed(3)
    q, k, v, ctx = make_case(gen, [100, 3, 57], 65, "tree", heads=9, kv_heads=3, dim=64, dtype=torch.bfloat16)
    want = float64_attention(q, k, v, ctx, 0.125)
    for splits in (1, 2, 8):
        got = tree_attention(q, k, v, ctx, 0.125, splits=splits).cpu().double()
        assert (got - want).abs().max() < 2e-2, splits


@needs_kernels
def test_split_merge_repeats_exactly():
    """Key ranges merged by log-sum-exp give the one-range result, launch after launch, for
    split counts from 2 to more ranges than the sequences have key tiles."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, ctx = make_case(gen, [300, 45, 130], 9, "tree", heads=6, kv_heads=2, dim=16)
    want = tree_attention(q, k, v, ctx, 0.25, splits=1)
    for splits in (2, 8, 8, 32, 2):
        for _ in range(3 if CUDA else 1):
            got = tree_attention(q, k, v, ctx, 0.25, splits=splits)
            assert (got - want).abs().max() < 1e-5, splits


@needs_kernels
def test_tree_mask_changes_the_output():
    """Guard against a kernel that ignores the mask: a chain and a star over the same keys differ."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, ctx = make_case(gen, [4], 6, "tree")
    chain = ancestor_mask(torch.tensor([[0, 0, 1, 2, 3, 4]]), 5).to(DEVICE)
    star = ancestor_mask(torch.tensor([[0, 0, 0, 0, 0, 0]]), 5).to(DEVICE)
    ctx.tree_mask = chain
    a = tree_attention(q, k, v, ctx, 0.25)
    ctx.tree_mask = star
    b = tree_attention(q, k, v, ctx, 0.25)
    assert torch.allclose(a[:2], b[:2], atol=1e-6)  # root and its first child see the same keys
    assert not torch.allclose(a[2:], b[2:], atol=1e-3)


@contextlib.contextmanager
def _torch_path():
    """Force the torch reference path of the layers (on CUDA they would pick Triton)."""
    old = os.environ.get("DDTREE_TRITON")
    os.environ["DDTREE_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DDTREE_TRITON"]
        else:
            os.environ["DDTREE_TRITON"] = old


@needs_kernels
def test_fused_layer_kernels_match_torch():
    """add+RMSNorm, qkv rotary + cache store (with and without q/k norm) and silu*mul against
    the torch path the CPU engine runs."""
    from ddtree.kernels import triton_layers as tl_ops
    from ddtree.models.layers import MLP, QKVProjection, RMSNorm, Rotary
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    T, hidden = 7, 48
    x = torch.randn(T, hidden, generator=gen).to(DEVICE)
    res = torch.randn(T, hidden, generator=gen).to(DEVICE)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data = torch.rand(hidden, generator=gen).to(DEVICE) + 0.5
    y, r = tl_ops.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.allclose(r, x + res) and torch.allclose(y, norm(x + res), atol=1e-5)
    y, r = tl_ops.add_rms_norm(x, None, norm.weight, norm.eps)
    assert torch.equal(r, x) and torch.allclose(y, norm(x), atol=1e-5)
    # the sum written into a column slice of a wider buffer (a tapped layer's output, in place)
    for residual in (res, None):
        taps = torch.zeros(T, 3 * hidden, device=DEVICE)
        y, r = tl_ops.add_rms_norm(x, residual, norm.weight, norm.eps, taps[:, hidden:2 * hidden])
        want = x + residual if residual is not None else x
        assert r.data_ptr() == taps[:, hidden:].data_ptr() and torch.allclose(taps[:, hidden:2 * hidden], want)
        assert torch.allclose(y, norm(want), atol=1e-5) and not taps[:, :hidden].any() and not taps[:, 2 * hidden:].any()

    mlp = MLP(hidden, 40).to(DEVICE)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], 1)
    want = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    assert torch.allclose(tl_ops.silu_mul(gate_up), want, atol=1e-6)

    positions = torch.tensor([0, 3, 4, 9, 10, 11, 30], device=DEVICE)
    slots = torch.tensor([5, 0, 7, 2, 9, 1, 3], device=DEVICE)
    # (T, query heads, kv heads, head dim, q/k norm): small; SmolLM2-like (15 heads, not a power
    # of two, so the kernel's head tile has a padding row); Qwen3-like (q/k norm, head dim 128)
    for T, nq, nkv, hd, qk_norm in ((7, 6, 2, 16, False), (7, 6, 2, 16, True), (5, 9, 3, 64, False),
                                    (5, 9, 3, 64, True), (3, 16, 8, 128, True)):
        xt, pos, sl = x[:T], positions[:T], slots[:T]
        cos, sin = Rotary(hd, 10000.0).to(DEVICE).cos_sin(pos)
        zeros = lambda: tuple(torch.zeros(10, nkv, hd, device=DEVICE) for _ in range(2))  # noqa: E731
        proj = QKVProjection(hidden, nq, nkv, hd, bias=True, qk_norm=qk_norm, eps=1e-6).to(DEVICE)
        if qk_norm:
            proj.q_norm.weight.data = torch.rand(hd, generator=gen).to(DEVICE) + 0.5
            proj.k_norm.weight.data = torch.rand(hd, generator=gen).to(DEVICE) + 0.5
        with torch.no_grad():
            ref_cache = zeros()
            with _torch_path():
                q_ref = proj.project_store(xt, cos, sin, ref_cache, sl)
            qkv = torch.cat([proj.q_proj(xt), proj.k_proj(xt), proj.v_proj(xt)], 1)
            cache = zeros()
            q = tl_ops.qkv_rope_store(qkv, nq, nkv, hd, cos, sin, sl, *cache, proj.q_norm, proj.k_norm)
            assert q.shape == (T, nq, hd) and torch.allclose(q, q_ref, atol=1e-5)
            assert torch.allclose(cache[0], ref_cache[0], atol=1e-5) and torch.equal(cache[1], ref_cache[1])
            kv_only = zeros()
            assert tl_ops.qkv_rope_store(qkv[:, nq * hd:], 0, nkv, hd, cos, sin, sl, *kv_only, None,
                                         proj.k_norm) is None
            assert torch.allclose(kv_only[0], ref_cache[0], atol=1e-5) and torch.equal(kv_only[1], ref_cache[1])


@needs_kernels
def test_tree_attention_reads_strided_metadata():
    """CUDA graphs feed block tables and lengths as column views of one packed buffer."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, ctx = make_case(gen, [9, 2, 14], 5, "tree")
    want = tree_attention(q, k, v, ctx, 0.25)
    N, W = ctx.block_tables.shape
    packed = torch.full((N, 3 + W), -7, dtype=torch.long, device=DEVICE)
    packed[:, 1] = ctx.cached_lens
    packed[:, 3:] = ctx.block_tables
    ctx.cached_lens, ctx.block_tables = packed[:, 1], packed[:, 3:]
    assert torch.equal(tree_attention(q, k, v, ctx, 0.25), want)


def compiled_variants(kernel) -> int:
    return sum(len(cache[0]) for cache in getattr(kernel, "device_caches", {}).values())


@needs_kernels
def test_contiguous_contexts_compile_one_kernel_for_every_length():
    """Full forwards (test references, drafter training) put fresh sequences back to back in
    one-slot pages: mixed lengths attend causally within their own sequence, and a new length
    compiles no new kernel variant (a page per longest sequence compiled one per length)."""
    from ddtree.kernels.triton_attention import _tree_attention_kernel
    gen = torch.Generator().manual_seed(13)
    lengths = [3, 7, 5]
    k, v = (torch.randn(sum(lengths), 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(sum(lengths), 6, 16, generator=gen).to(DEVICE)
    ctx = AttentionContext.contiguous(lengths, device=DEVICE)
    assert ctx.slot_mapping.tolist() == list(range(sum(lengths)))
    torch.testing.assert_close(tree_attention(q, k, v, ctx, 0.25).cpu().double(),
                               float64_attention(q, k, v, ctx, 0.25), atol=1e-5, rtol=1e-5)
    # One launch plan for every length, so only the context could make a new variant (counted on
    # CUDA; Triton's interpreter compiles nothing, so there this part checks nothing).
    plan = dict(splits=1, rows_per_query=3, block_m=64, unmasked_tiles=True)
    tree_attention(q[:8], k, v, AttentionContext.contiguous([8], device=DEVICE), 0.25, **plan)
    before = compiled_variants(_tree_attention_kernel)
    for n in (9, 11, 12):
        tree_attention(q[:n], k, v, AttentionContext.contiguous([n], device=DEVICE), 0.25, **plan)
    assert compiled_variants(_tree_attention_kernel) == before


@pytest.mark.parametrize("budget,depth,vocab", [(1, 4, 9), (3, 3, 5), (8, 6, 7), (32, 15, 50), (100, 5, 3),
                                                (64, 6, 400), (70, 5, 30)])
@needs_kernels
def test_triton_tree_builder_matches_torch_builder(budget, depth, vocab):
    """The full tree (root first) and its ancestor mask, exactly as the torch builder's. Rows: a
    spread distribution (shallow, bushy trees: the kernel stops at the first depth that cannot
    enter the tree), many ties (across depths too), and one likely token per depth (trees as deep
    as the drafter's block: no early stop)."""
    from ddtree.kernels.triton_tree import build_tree_triton
    from ddtree.tree import ancestor_mask, build_tree_batched, with_root
    gen = torch.Generator().manual_seed(budget + depth)
    lp = torch.log_softmax(torch.randn(3, depth, vocab, generator=gen) * 3, -1)
    lp[1] = torch.log_softmax(torch.randint(0, 3, (depth, vocab), generator=gen).float(), -1)  # many ties
    peaked = torch.randn(depth, vocab, generator=gen)
    peaked[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=gen)] += 12.0
    lp[2] = torch.log_softmax(peaked, -1)
    lp = lp.to(DEVICE)
    roots = torch.tensor([5, 0, vocab - 1], device=DEVICE)
    want = with_root(roots, *build_tree_batched(lp, budget))
    want = (*want, ancestor_mask(want[1], depth))
    got = build_tree_triton(lp, budget, roots)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert got[3][:, 0, 0].all() and got[3].sum() > 0


@pytest.mark.parametrize("budget,depth", [(8, 6), (63, 15), (3, 3)])
@needs_kernels
def test_triton_accept_walk_matches_torch(budget, depth):
    """The fused walk returns the torch walk's path, accepted count and bonus token, on trees
    where the target's samples follow a random root path for a random number of steps (from
    nothing accepted to a leaf), and on a chain."""
    from ddtree.kernels.triton_tree import accept_walk_triton
    from ddtree.tree import accept_walk, ancestor_mask, build_tree_batched, chain_tree, with_root
    gen = torch.Generator().manual_seed(budget)
    N, vocab = 12, 6
    lp = torch.log_softmax(torch.randn(N, depth, vocab, generator=gen) * 2, -1)
    trees = [with_root(torch.arange(N) % vocab, *build_tree_batched(lp, budget))]
    trees.append(with_root(torch.arange(N) % vocab, *chain_tree(lp)))
    for tokens, parents, depths in trees:
        T = tokens.shape[1]
        samples = torch.randint(vocab, 2 * vocab, (N, T), generator=gen)  # no token: accepts only below
        for n in range(N):  # walk down: the target samples one child's token at each step
            node, steps = 0, n % (depth + 1)
            for _ in range(steps):
                kids = [c for c in range(1, T) if parents[n, c] == node]
                if not kids:
                    break
                child = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                samples[n, node] = tokens[n, child]
                node = child
        max_depth = min(depth, T - 1)
        want = accept_walk(tokens, parents, depths, samples, max_depth, ancestor_mask(parents, max_depth))
        got = accept_walk_triton(*(x.to(DEVICE) for x in (tokens, parents, depths, samples)), max_depth)
        for w, g in zip(want, got):
            assert torch.equal(w, g.cpu())
        assert want[1].max() > 2 and want[1].min() == 1  # deep paths and nothing accepted both occur


def topk_inputs(k: int, vocab: int) -> torch.Tensor:
    """[3, 3, vocab] log-probs: spread rows, heavy ties (-0.0 among them), and a row whose top
    k+2 entries sit together (one chunk holds the whole top)."""
    gen = torch.Generator().manual_seed(k + vocab)
    x = torch.log_softmax(torch.randn(3, 3, vocab, generator=gen) * 3, -1)
    x[1] = torch.randint(-3, 1, (3, vocab), generator=gen).float()
    x[1, 0, :vocab // 2] = -0.0
    x[2, 1, :min(k + 2, vocab)] = 5.0 + torch.arange(min(k + 2, vocab)).float()
    return x


# skip=False only where it changes the path (k below the chunk count); the interpreter is slow.
@pytest.mark.parametrize("k,vocab,chunk,skip", [(1, 7, None, True), (5, 50, 8, True), (5, 50, 8, False),
                                               (3, 100, 8, True), (3, 100, 8, False), (32, 300, 64, True),
                                               (100, 450, 128, True), (128, 700, 256, True)]
                         + ([(32, 49152, None, True), (64, 49152, None, True), (8, 49152, 512, False),
                             (128, 151936, None, True)] if CUDA else []))
# Triton's own top-k where this Triton has it (>= 3.4), and the full-sort fallback always.
@pytest.mark.parametrize("use_tl_topk", [False] + ([True] if hasattr(triton.language, "topk") else []))
@needs_kernels
def test_triton_topk_matches_topk_per_depth(k, vocab, chunk, use_tl_topk, skip):
    """Values and ids exactly as the shared top-k (value desc, smaller id first on ties, -0.0 ==
    +0.0), with many ties and chunk boundaries; with Triton's bitonic top-k and with full sorts;
    sorting only the chunks that can win (skip) or every chunk. A row whose top entries sit in
    one chunk (ranks 2..k of the other chunks' maxima lose to it) tests the skip rule's bound."""
    from ddtree.kernels.triton_tree import topk_triton
    from ddtree.tree import topk_per_depth
    x = topk_inputs(k, vocab)
    want = topk_per_depth(x, k)
    got = topk_triton(x.to(DEVICE), k, chunk, use_tl_topk=use_tl_topk, skip=skip,  # small chunks: many boundaries
                      method="chunk")
    assert torch.equal(got[1].cpu(), want[1])
    assert torch.equal(got[0].cpu(), want[0])


# Small caps (the interpreter is slow): the heavy-tie rows overflow them and take the exact row
# scan, the others fit; on CUDA also the vocabularies and k the engine runs.
@pytest.mark.parametrize("k,vocab,small,big,cap", [(2, 9, None, 2048, 4), (5, 50, 8, 16, 16),
                                                   (3, 100, 8, 32, 8), (12, 200, None, 64, 32)]
                         + ([(7, 49152, None, 2048, 1024), (63, 49152, None, 2048, 1024),
                             (127, 49152, None, 2048, 1024), (31, 151936, None, 2048, 512)] if CUDA else []))
@needs_kernels
def test_threshold_topk_matches_topk_per_depth(k, vocab, small, big, cap):
    """The threshold plan gives exactly the shared top-k (values and ids, ties to the smaller id,
    -0.0 == +0.0), whether a row's candidates fit the cap or overflow it into the exact scan; a
    row whose top entries all sit in one chunk (the threshold far below its k-th value); logits
    normalised to the log-softmax's values."""
    from ddtree.kernels.triton_tree import topk_threshold_triton
    from ddtree.tree import topk_per_depth
    x = topk_inputs(k, vocab)
    want = topk_per_depth(x, k)
    got = topk_threshold_triton(x.to(DEVICE), k, small, big, cap)
    assert torch.equal(got[1].cpu(), want[1])
    assert torch.equal(got[0].cpu(), want[0])
    logits = x[0] * 2 + 7
    vals, ids = topk_threshold_triton(logits.to(DEVICE), k, small, big, cap, normalize=True)
    want_ids = topk_per_depth(logits, k)[1]
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.allclose(vals.cpu().double(), torch.log_softmax(logits.double(), -1).gather(-1, want_ids),
                          atol=2e-5, rtol=0)


@pytest.mark.parametrize("k,vocab,chunk", [(1, 7, None), (4, 100, 8), (32, 300, 64)]
                         + ([(8, 49152, None), (32, 49152, None)] if CUDA else []))
@needs_kernels
def test_triton_topk_normalizes_logits(k, vocab, chunk):
    """From logits: the ids of the logits' own top-k and log-softmax values (the round drafts
    logits and skips the full log-softmax)."""
    from ddtree.kernels.triton_tree import topk_triton
    from ddtree.tree import topk_per_depth
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(2, 5, vocab, generator=gen) * 4 + 7  # far from normalised
    want_ids = topk_per_depth(logits, k)[1]
    want_vals = torch.log_softmax(logits.double(), -1).gather(-1, want_ids)
    vals, ids = topk_triton(logits.to(DEVICE), k, chunk, normalize=True)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.allclose(vals.cpu().double(), want_vals, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_kernels
def test_triton_kv_compaction_matches_torch(dtype):
    """The fused compaction moves exactly what the torch plan moves, including chains of moves
    where one move's destination is a later move's source, and leaves every other slot alone."""
    from ddtree.kernels.triton_tree import compact_kv_triton
    from ddtree.tree import compaction_moves, gather_rows
    gen = torch.Generator().manual_seed(0)
    N, T, L, slots_total = 5, 12, 6, 90
    kv = torch.randn(3, 2, slots_total, 2, 12, generator=gen).to(dtype)  # row of 24: padded lanes
    slots = torch.randperm(slots_total, generator=gen)[:N * T].view(N, T)  # sequences own their slots
    paths = [[0, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [0, 3, 7, 9, 11, 0], [0, 5, 6, 0, 0, 0],
             [0, 1, 4, 8, 10, 11]]
    path = torch.tensor(paths)
    num_accepted = torch.tensor([6, 6, 5, 3, 1])
    src_off, dst_off, move = compaction_moves(path, num_accepted)
    dst = gather_rows(slots, dst_off)
    src = torch.where(move, gather_rows(slots, src_off), dst).reshape(-1)
    want = kv.clone()
    want[:, :, dst.reshape(-1)] = want[:, :, src]
    got = kv.clone().to(DEVICE)
    compact_kv_triton(got, path.to(DEVICE), num_accepted.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, kv)  # the case moves something


@pytest.mark.parametrize("num_new,with_depths,with_rope", [(1, False, True), (5, True, True), (16, False, False)])
@needs_kernels
def test_uniform_meta_matches_torch(num_new, with_depths, with_rope):
    """One launch gives the slots, positions and rotary rows that the torch path of
    AttentionContext.uniform computes, from strided views of a step's input buffer (as a
    captured round reads them); a position past the rope table reads its last row."""
    from ddtree.kernels.triton_meta import uniform_meta
    from ddtree.models.layers import Rotary
    gen = torch.Generator().manual_seed(1)
    N, width = 4, 6
    ints = torch.zeros(N, 3 + width, dtype=torch.long)
    ints[:, 3:] = torch.randperm(40, generator=gen)[:N * width].view(N, width)
    ints[:, 1] = torch.tensor([0, 3, 9, 21])  # the last one runs past the table's width: clamped
    tables, cached = ints[:, 3:], ints[:, 1]
    depths = torch.randint(0, 4, (N, num_new), generator=gen) if with_depths else None
    table = Rotary(8, 10000.0).table(24) if with_rope else None
    want = AttentionContext.uniform(tables, cached, num_new, PAGE, 64, depths=depths, rope_table=table)
    slots, positions, rope = uniform_meta(tables.to(DEVICE), cached.to(DEVICE), num_new, PAGE,
                                          None if depths is None else depths.to(DEVICE),
                                          None if table is None else table.to(DEVICE))
    assert torch.equal(slots.cpu(), want.slot_mapping)
    assert torch.equal(positions.cpu(), want.positions)
    if with_rope:
        assert torch.equal(rope.cpu(), want.rope)
        assert int(want.positions.max()) >= table.shape[0] or num_new == 1
        cos, sin = Rotary.split(want.rope)
        ok = want.positions < table.shape[0]
        ref_cos, ref_sin = Rotary(8, 10000.0).cos_sin(want.positions[ok])
        assert torch.equal(cos[ok], ref_cos) and torch.equal(sin[ok], ref_sin)
    else:
        assert rope is None


@needs_kernels
def test_triton_sampler_draws_from_softmax_at_the_temperature():
    """Gumbel-max over two vocabulary blocks: draws match softmax(logits / T) by chi-square
    (T = 1 and 0.5), a greedy row takes the first maximal logit (tied across blocks), the same
    seed repeats its draws, and the device seed advances so the next call draws afresh. With few
    rows a row's blocks are split over several programs: the same draws (each entry has its own
    Philox counter), and a greedy tie across splits still goes to the first index."""
    from scipy.stats import chisquare
    from ddtree.kernels.triton_sample import sample_gumbel_triton
    gen = torch.Generator().manual_seed(0)
    V, rows = 8, 400 if INTERPRETED else 20000  # the interpreter runs ~60 programs a second
    base = torch.randn(V, generator=gen) * 1.5
    seed = torch.tensor([1234], device=DEVICE)
    got = sample_gumbel_triton(base.expand(2, rows, V).to(DEVICE), torch.tensor([1.0, 0.5], device=DEVICE),
                               seed, block=4).cpu()
    assert int(seed) == 1235
    for row, t in ((0, 1.0), (1, 0.5)):
        expected = torch.softmax(base.double() / t, -1) * rows
        observed = torch.bincount(got[row], minlength=V).double()
        big = expected >= 5  # pool rare tokens so the chi-square approximation holds
        obs, exp = observed[big], expected[big]
        if not big.all():  # (an empty pool would be a 0/0 term)
            obs, exp = torch.cat([obs, observed[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3, t

    tied = base.clone()
    tied[1] = tied[6] = base.max() + 1
    few = torch.stack([tied, base]).view(2, 1, V).expand(2, 16, V).to(DEVICE)
    temps = torch.tensor([0.0, 1.0], device=DEVICE)
    seed.fill_(99)
    first = sample_gumbel_triton(few, temps, seed, block=4).cpu()
    assert torch.all(first[0] == 1)
    seed.fill_(99)
    assert torch.equal(sample_gumbel_triton(few, temps, seed, block=4).cpu(), first)
    assert not torch.equal(sample_gumbel_triton(few, temps, seed, block=4).cpu()[1], first[1])

    # 128 rows of V = 8 in blocks of 4: two programs per row (splits = ceil(528 / 128) capped at
    # the row's 2 blocks), yet the first call's draws, so the same chi-square holds.
    seed.fill_(1234)
    split = sample_gumbel_triton(base.expand(1, 128, V).to(DEVICE), torch.tensor([1.0], device=DEVICE),
                                 seed, block=4).cpu()[0]
    assert torch.equal(split, got[0, :128])
    expected = torch.softmax(base.double(), -1) * 128
    big = expected >= 5
    observed = torch.bincount(split, minlength=V).double()
    obs, exp = observed[big], expected[big]
    if not big.all():
        obs, exp = torch.cat([obs, observed[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3

    # V = 16 in blocks of 4 over 4 programs (entry k * 4 + j is in split j): the maximum at 13
    # (split 1) and 2 (split 2) gives 2; a constant row and an all -inf row give 0.
    greedy = torch.zeros(3, 16)
    greedy[0, [2, 10, 13]] = 5.0
    greedy[0, [0, 5]] = float("-inf")
    greedy[2] = float("-inf")
    got = sample_gumbel_triton(greedy[None].to(DEVICE), torch.tensor([0.0], device=DEVICE), seed, block=4)
    assert got.cpu().tolist() == [[2, 0, 0]]


def chisquare_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities, rare bins pooled (expected < 5)."""
    from scipy.stats import chisquare
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs, exp = counts.double()[big], expected[big]
    if not big.all():  # (an empty pool would be a 0/0 term)
        obs = torch.cat([obs, counts.double()[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_lm_head_sample_greedy_rows_take_the_first_maximal_logit(dtype):
    """Integer-valued hidden states and weights make every logit exact whatever the order of the
    sums, so the fused head must return exactly the first argmax among many exact ties, for a
    greedy batch and for the greedy sequence of a sampled batch, whatever the tile plan; a NaN
    logit (a NaN row of W) never wins. V = 50 is not a multiple of the tiles or of the 16-column
    groups, and 18 rows do not fill the last row tile."""
    from ddtree.kernels.triton_lm_head import lm_head_sample_triton
    gen = torch.Generator().manual_seed(3)
    N, T, H, V = 2, 9, 40, 50
    hidden = torch.randint(-2, 3, (N * T, H), generator=gen).to(dtype).to(DEVICE)
    weight = torch.randint(-2, 3, (V, H), generator=gen).to(dtype).to(DEVICE)
    weight[7] = float("nan")
    want = (hidden.double() @ weight.double().T).nan_to_num(float("-inf")).argmax(-1).cpu()
    for plan in ((16, 16, 16, 4, 1), (32, 64, 32, 4, 2)):
        seed = torch.tensor([77], device=DEVICE)
        greedy = lm_head_sample_triton(hidden, weight, torch.zeros(N, device=DEVICE), seed, T, False, plan)
        assert torch.equal(greedy.cpu(), want) and int(seed) == 77, plan
        mixed = lm_head_sample_triton(hidden, weight, torch.tensor([0.0, 0.7], device=DEVICE), seed, T, True, plan)
        assert torch.equal(mixed.cpu()[:T], want[:T]) and int(seed) == 78, plan
        assert (mixed.cpu() != 7).all()


@needs_kernels
@pytest.mark.parametrize("plan", [(16, 16, 16, 4, 1), (16, 32, 16, 4, 1)])
def test_lm_head_sample_draws_from_softmax(plan):
    """Sampled rows are draws from softmax(logits / T): chi-square at T = 1 and 0.5 over rows that
    share one hidden state, V = 40 over three 16-column tiles (the last one partial) or two
    32-column tiles of two 16-column groups (the pick scans tiles, then groups), a NaN logit never
    drawn; the same seed repeats its draws and the advanced seed draws afresh."""
    from ddtree.kernels.triton_lm_head import lm_head_sample_triton
    gen = torch.Generator().manual_seed(5)
    H, V, rows = 16, 40, 250 if INTERPRETED else 20000  # the interpreter runs ~40 rows a second
    weight = torch.randn(V, H, generator=gen) * 0.6
    weight[11] = float("nan")
    h = torch.randn(H, generator=gen)
    # the row's maximum in the last tile, so the other tiles' weights are scaled to the row's
    weight[35] = h / h.dot(h) * ((weight[:11] @ h).max() + 0.5)
    weight = weight.to(DEVICE)
    logits = (weight.cpu().double() @ h.double()).nan_to_num(float("-inf"))
    hidden = h.expand(2 * rows, H).contiguous().to(DEVICE)
    temps = torch.tensor([1.0, 0.5], device=DEVICE)
    seed = torch.tensor([1234], device=DEVICE)
    got = lm_head_sample_triton(hidden, weight, temps, seed, rows, True, plan).cpu().view(2, rows)
    assert int(seed) == 1235 and (got != 11).all()
    for i, t in enumerate((1.0, 0.5)):
        counts = torch.bincount(got[i], minlength=V)
        assert chisquare_pvalue(counts, torch.softmax(logits / t, -1)) > 1e-3, t
    few = hidden[:16]
    seed.fill_(99)
    first = lm_head_sample_triton(few, weight, temps, seed, 8, True, plan).cpu()
    seed.fill_(99)
    assert torch.equal(lm_head_sample_triton(few, weight, temps, seed, 8, True, plan).cpu(), first)
    assert not torch.equal(lm_head_sample_triton(few, weight, temps, seed, 8, True, plan).cpu(), first)


@pytest.mark.skipif(CUDA or INTERPRETED, reason="CPU only: the kernels run directly on CUDA")
def test_kernels_under_triton_interpreter():
    """Every kernel test above, in Triton's interpreter, in a fresh process."""
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
