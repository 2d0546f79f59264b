"""Tests for ddtree.tree: tree building, layout, sampling and acceptance."""

import inspect
import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from ddtree.tree import (
    accept_walk,
    ancestor_mask,
    build_tree_batched,
    build_tree_heap,
    chain_tree,
    compaction_moves,
    effective_budget,
    filtered_probs,
    gather_rows,
    positions,
    sample_from_logits,
    topk_per_depth,
    with_root,
)

BUDGETS = [0, 1, 2, 3, 5, 8, 16, 33, 64]


# ----------------------------------------------------------------- helpers


def random_logprobs(n, d, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, d, v, generator=g) * 2.0, dim=-1)


def tie_logprobs(n, d, v, seed, levels=3, neg_inf_frac=0.0):
    """Logits quantised to a few levels (many exact ties), optionally with -inf."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (n, d, v), generator=g).float()
    if neg_inf_frac > 0:
        drop = torch.rand(n, d, v, generator=g) < neg_inf_frac
        drop[..., 0] = False  # keep each row normalisable
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def assert_batched_equals_heap(logprobs, budget):
    n, d, v = logprobs.shape
    tok, par, dep = build_tree_batched(logprobs, budget)
    size = effective_budget(budget, d, v)
    assert tok.shape == par.shape == dep.shape == (n, size)
    for i in range(n):
        h_tok, h_par, h_dep = build_tree_heap(logprobs[i], budget)
        assert h_tok.shape == (size,)
        assert torch.equal(tok[i], h_tok), (i, budget)
        assert torch.equal(par[i], h_par), (i, budget)
        assert torch.equal(dep[i], h_dep), (i, budget)


def f32_add(a, b):
    return (torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)).item()


def brute_force_order(logprobs, k):
    """Every prefix (as a rank tuple) in the rule-3 order, computed depth by depth.

    Two same-depth prefixes with equal score compare by their parents'
    position, which only needs the order inside the parents' depth.
    Returns (ordered list of (rank_tuple, score)), token table.
    """
    lp, tok = topk_per_depth(logprobs[None], k)
    lp, tok = lp[0].tolist(), tok[0].tolist()
    D = len(lp)
    by_depth = []  # per depth: list of (ranks, score) in within-depth order
    prev = [((), 0.0)]
    for d in range(D):
        pos = {ranks: i for i, (ranks, _) in enumerate(prev)}
        cand = [(ranks + (r,), f32_add(s, lp[d][r])) for ranks, s in prev for r in range(k)]
        cand.sort(key=lambda c: (-c[1], pos[c[0][:-1]], c[0][-1]))
        by_depth.append(cand)
        prev = cand
    everything = [
        (-score, depth, i, ranks, score)
        for depth, cand in enumerate(by_depth)
        for i, (ranks, score) in enumerate(cand)
    ]
    everything.sort(key=lambda e: e[:3])
    return [(e[3], e[4]) for e in everything], tok


def node_rank_tuples(tok_table, tokens, parents, depths):
    """Rank tuple of every output node, from its token path."""
    out = []
    for j in range(len(tokens)):
        d, p = int(depths[j]), int(parents[j])
        prefix = () if p == 0 else out[p - 1]
        out.append(prefix + (tok_table[d - 1].index(int(tokens[j])),))
    return out


def python_ancestor_mask(parents_full):
    T = len(parents_full)
    m = [[False] * T for _ in range(T)]
    for i in range(T):
        j = i
        while True:
            m[i][j] = True
            if j == 0:
                break
            j = parents_full[j]
    return m


def python_walk(tokens, parents, samples, max_depth):
    cur, path = 0, [0]
    children = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], []).append(i)
    while len(path) <= max_depth:
        nxt = [c for c in children.get(cur, []) if tokens[c] == samples[cur]]
        assert len(nxt) <= 1
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    num = len(path)
    path = path + [path[-1]] * (max_depth + 1 - num)
    return path, num, samples[cur]


def random_full_trees(n, d, v, budget, seed):
    lp = random_logprobs(n, d, v, seed)
    tok, par, dep = build_tree_batched(lp, budget)
    g = torch.Generator().manual_seed(seed + 1)
    root = torch.randint(0, v, (n,), generator=g)
    return with_root(root, tok, par, dep)


# ---------------------------------------------------------- effective budget


def test_effective_budget_values():
    assert effective_budget(10, 2, 2) == 6  # 2 + 4
    assert effective_budget(6, 2, 2) == 6
    assert effective_budget(5, 2, 2) == 5
    assert effective_budget(0, 5, 100) == 0
    assert effective_budget(7, 0, 100) == 0
    assert effective_budget(7, 3, 0) == 0
    assert effective_budget(100, 3, 1) == 3  # a single chain
    assert effective_budget(10, 3, 4) == 10
    # Huge depth / vocab: must not build giant numbers or loop forever.
    assert effective_budget(10**6, 10**9, 10**6) == 10**6


def test_negative_budget_raises():
    lp = random_logprobs(2, 3, 5, 0)
    for fn in (lambda: effective_budget(-1, 3, 5),
               lambda: build_tree_heap(lp[0], -1),
               lambda: build_tree_batched(lp, -2)):
        with pytest.raises(ValueError, match="budget"):
            fn()


def test_budget_zero_gives_empty_trees():
    lp = random_logprobs(3, 4, 7, 1)
    tok, par, dep = build_tree_batched(lp, 0)
    assert tok.shape == par.shape == dep.shape == (3, 0)
    assert tok.dtype == par.dtype == dep.dtype == torch.long
    h = build_tree_heap(lp[0], 0)
    assert all(x.shape == (0,) and x.dtype == torch.long for x in h)


def test_topk_per_depth_stable_ties():
    lp = torch.tensor([[[0.0, 1.0, 1.0, 0.5, 1.0]]])
    vals, idx = topk_per_depth(lp, 4)
    assert vals.dtype == torch.float32 and idx.dtype == torch.long
    assert idx.tolist() == [[[1, 2, 4, 3]]]
    assert vals.tolist() == [[[1.0, 1.0, 1.0, 0.5]]]


def _stable_topk_reference(x, k):
    vals, idx = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _topk_inputs():
    g = torch.Generator().manual_seed(123)
    yield "random", random_logprobs(3, 4, 97, 5)
    yield "ties2", tie_logprobs(3, 4, 97, 6, levels=2)
    yield "ties3", tie_logprobs(4, 3, 64, 7, levels=3)
    yield "ties3_inf", tie_logprobs(3, 4, 97, 8, levels=3, neg_inf_frac=0.5)
    yield "mostly_inf", tie_logprobs(3, 4, 97, 9, levels=2, neg_inf_frac=0.97)
    yield "all_equal", torch.log_softmax(torch.zeros(2, 3, 50), -1)
    # raw (unnormalised) values with heavy ties, signed zeros, +-inf
    raw = torch.randint(-2, 3, (5, 6, 80), generator=g).float()
    raw[raw == 2] = float("inf")
    raw[raw == -2] = float("-inf")
    raw[(raw == 0) & (torch.rand(raw.shape, generator=g) < 0.5)] = -0.0
    yield "raw", raw
    yield "raw_1d", raw[0, 0]
    yield "fp16", (torch.randn(2, 3, 70, generator=g) * 2).half().round().float().half()


@pytest.mark.parametrize("name,x", list(_topk_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_topk_per_depth_matches_full_stable_sort(name, x):
    import ddtree.tree.build as build_mod

    v = x.shape[-1]
    for k in sorted({0, 1, 2, 3, 7, 8, 16, v // 2, v - 1, v, v + 5}):
        ref_v, ref_i = _stable_topk_reference(x, k)
        got_v, got_i = topk_per_depth(x, k)
        assert got_v.dtype == torch.float32 and got_i.dtype == torch.long
        assert torch.equal(got_i, ref_i), (name, k)
        assert torch.equal(got_v, ref_v), (name, k)
        # sign of zero must match too (values are gathered, not recomputed)
        assert torch.equal(torch.signbit(got_v), torch.signbit(ref_v)), (name, k)
        if 0 < k <= v:
            # the selection path itself, including k == V (which
            # topk_per_depth routes to the full sort)
            sel_v, sel_i = build_mod._topk_select(x.float(), k)
            assert torch.equal(sel_i, ref_i), (name, k)
            assert torch.equal(sel_v, ref_v) and torch.equal(torch.signbit(sel_v), torch.signbit(ref_v))
        assert torch.equal(build_mod._topk_per_depth_reference(x, k)[1], ref_i)


def test_topk_per_depth_large_vocab_ties():
    # vocab-sized rows where the k-th value is tied far beyond k entries
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (2, 3, 49152), generator=g).float()
    x[0, 0, 1000:1010] = 10.0  # a few distinct top values, then a huge tie
    x[1, 2] = float("-inf")
    x[1, 2, 40000] = 0.0
    for k in (8, 16, 64, 256):
        ref_v, ref_i = _stable_topk_reference(x, k)
        got_v, got_i = topk_per_depth(x, k)
        assert torch.equal(got_i, ref_i) and torch.equal(got_v, ref_v), k


def test_topk_select_has_no_sync_calls():
    import ddtree.tree.build as build_mod

    src = inspect.getsource(build_mod._topk_select)
    for bad in (".item(", ".tolist(", ".cpu(", "nonzero"):
        assert bad not in src, bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_topk_per_depth_on_cuda_matches_reference():
    for name, x in _topk_inputs():
        v = x.shape[-1]
        for k in (1, 5, v // 2, v - 1, v):
            ref_v, ref_i = _stable_topk_reference(x, k)
            got_v, got_i = topk_per_depth(x.cuda(), k)
            assert torch.equal(got_i.cpu(), ref_i) and torch.equal(got_v.cpu(), ref_v), (name, k)


# ------------------------------------------------------ batched == heap


@pytest.mark.parametrize("shape", [(4, 11), (6, 40)])
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("budget", BUDGETS)
def test_batched_matches_heap_random(shape, n, budget):
    d, v = shape
    lp = random_logprobs(n, d, v, seed=1000 * budget + 10 * n + d)
    assert_batched_equals_heap(lp, budget)


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("budget", BUDGETS)
def test_batched_matches_heap_ties(levels, budget):
    lp = tie_logprobs(5, 5, 9, seed=budget + 100 * levels, levels=levels)
    assert_batched_equals_heap(lp, budget)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_batched_matches_heap_uniform(budget):
    # Every prefix of a given depth has exactly the same score.
    lp = torch.log_softmax(torch.zeros(3, 4, 6), dim=-1)
    assert_batched_equals_heap(lp, budget)


@pytest.mark.parametrize("budget", [3, 8, 33, 64])
def test_batched_matches_heap_neg_inf(budget):
    # Underflowed / masked probabilities: many real scores are exactly -inf.
    lp = tie_logprobs(4, 4, 8, seed=budget, levels=3, neg_inf_frac=0.6)
    assert torch.isinf(lp).any()
    assert_batched_equals_heap(lp, budget)


def test_budget_exceeds_available_prefixes():
    lp = random_logprobs(3, 2, 2, 5)
    tok, par, dep = build_tree_batched(lp, 10)
    assert tok.shape == (3, 6)
    assert_batched_equals_heap(lp, 10)
    # The whole binary tree of depth 2 is present.
    for i in range(3):
        assert sorted(dep[i].tolist()) == [1, 1, 2, 2, 2, 2]
    # Also with a tie-heavy tiny vocab and deeper trees.
    assert_batched_equals_heap(tie_logprobs(2, 3, 2, 6, levels=2), 64)


@pytest.mark.parametrize("budget", [1, 3, 5, 8])
def test_tree_of_budget_b_reads_only_the_first_b_depths(budget):
    """The engine drafts only min(S-1, b) depths for a b-node tree: a tree's node at depth d
    needs its d-1 ancestors, so the deeper logits cannot change it (random and tied scores)."""
    for lp in (random_logprobs(4, 9, 12, seed=budget), tie_logprobs(4, 9, 6, seed=budget, levels=2)):
        full, cut = build_tree_batched(lp, budget), build_tree_batched(lp[:, :budget], budget)
        for a, b in zip(full, cut):
            assert torch.equal(a, b)


# --------------------------------------------------- optimality / tie rule


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heap_is_top_budget_by_score(seed):
    d, v = 3, 4
    lp = random_logprobs(1, d, v, seed)[0]
    q = lp.double().exp()
    all_mass = sorted(
        (math.prod(q[i, u[i]].item() for i in range(len(u)))
         for depth in range(1, d + 1)
         for u in itertools.product(range(v), repeat=depth)),
        reverse=True,
    )
    for budget in range(1, 85):
        tok, par, dep = build_tree_heap(lp, budget)
        paths = []
        for j in range(len(tok)):
            p = int(par[j])
            paths.append((paths[p - 1] if p else ()) + (int(tok[j]),))
        assert len(set(paths)) == len(paths) == min(budget, 84)
        assert all(len(u) == 1 or u[:-1] in set(paths) for u in paths)  # prefix-closed
        mass = sum(math.prod(q[i, u[i]].item() for i in range(len(u))) for u in paths)
        assert mass == pytest.approx(sum(all_mass[:len(paths)]), abs=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_heap_follows_exact_tie_rule(tie):
    d, v = 3, 4
    for seed in range(3):
        lp = (tie_logprobs(1, d, v, seed, levels=2) if tie else random_logprobs(1, d, v, seed))[0]
        for budget in [1, 3, 4, 7, 20, 84, 100]:
            k = min(budget, v)
            order, tok_table = brute_force_order(lp, k)
            tok, par, dep = build_tree_heap(lp, budget)
            got = node_rank_tuples(tok_table, tok, par, dep)
            want = [ranks for ranks, _ in order[:budget]]
            assert got == want, (seed, budget)


def test_heap_optimal_among_all_prefix_closed_trees():
    d, v = 2, 3
    prefixes = [u for depth in (1, 2) for u in itertools.product(range(v), repeat=depth)]
    for seed in range(4):
        lp = random_logprobs(1, d, v, 50 + seed)[0]
        q = lp.double().exp()
        mass = {u: math.prod(q[i, u[i]].item() for i in range(len(u))) for u in prefixes}
        for budget in range(1, 5):
            best = max(
                sum(mass[u] for u in subset)
                for subset in itertools.combinations(prefixes, budget)
                if all(len(u) == 1 or u[:-1] in subset for u in subset)
            )
            tok, par, dep = build_tree_heap(lp, budget)
            paths = []
            for j in range(len(tok)):
                p = int(par[j])
                paths.append((paths[p - 1] if p else ()) + (int(tok[j]),))
            assert sum(mass[u] for u in paths) == pytest.approx(best, abs=1e-9)


# ------------------------------------------------------------- structure


@pytest.mark.parametrize("tie", [False, True])
def test_tree_structure(tie):
    n, d, v = 6, 5, 12
    lp = tie_logprobs(n, d, v, 3) if tie else random_logprobs(n, d, v, 3)
    for budget in [1, 7, 33, 64]:
        tok, par, dep = build_tree_batched(lp, budget)
        _, top_tok = topk_per_depth(lp, min(budget, v))
        for i in range(n):
            seen = set()
            for j in range(tok.shape[1]):
                p, dj = int(par[i, j]), int(dep[i, j])
                assert 0 <= p < j + 1  # topological
                assert 1 <= dj <= d
                assert dj == (1 if p == 0 else int(dep[i, p - 1]) + 1)
                assert int(tok[i, j]) in top_tok[i, dj - 1].tolist()
                assert (p, int(tok[i, j])) not in seen  # sibling tokens distinct
                seen.add((p, int(tok[i, j])))


def test_chain_tree():
    lp = random_logprobs(4, 5, 9, 7)
    lp[0, 2] = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0, 3.0, 0, 0, 0, 0, 0]), -1)
    tok, par, dep = chain_tree(lp)
    assert tok.shape == par.shape == dep.shape == (4, 5)
    for i in range(4):
        for j in range(5):
            row = lp[i, j].tolist()
            assert int(tok[i, j]) == row.index(max(row))  # first max
    assert tok[0, 2].item() == 1
    assert par.tolist() == [list(range(5))] * 4
    assert dep.tolist() == [list(range(1, 6))] * 4
    taken = chain_tree(lp.argmax(-1) * 1)  # the argmax tokens already taken: the same chain
    assert all(torch.equal(a, b) for a, b in zip(taken, (tok, par, dep)))
    with pytest.raises(ValueError, match="argmax tokens"):
        chain_tree(lp[0])


# ----------------------------------------------------------------- layout


def test_with_root_and_positions():
    tok, par, dep = build_tree_batched(random_logprobs(2, 3, 5, 9), 6)
    root = torch.tensor([11, 22])
    tf, pf, df = with_root(root, tok, par, dep)
    assert tf.shape == pf.shape == df.shape == (2, 7)
    assert tf[:, 0].tolist() == [11, 22] and torch.equal(tf[:, 1:], tok)
    assert pf[:, 0].tolist() == [0, 0] and torch.equal(pf[:, 1:], par)
    assert df[:, 0].tolist() == [0, 0] and torch.equal(df[:, 1:], dep)
    pos = positions(torch.tensor([5, 100]), df)
    assert torch.equal(pos, torch.tensor([[5], [100]]) + df)


@pytest.mark.parametrize("budget", [1, 9, 40])
def test_ancestor_mask_matches_loop(budget):
    d = 6
    tf, pf, df = random_full_trees(3, d, 7, budget, seed=budget)
    mask = ancestor_mask(pf, d)
    assert mask.dtype == torch.bool and mask.shape == (3, pf.shape[1], pf.shape[1])
    for i in range(3):
        assert mask[i].tolist() == python_ancestor_mask(pf[i].tolist())
    # Too few steps cannot reach the root from deep nodes.
    if int(df.max()) >= 2:
        assert not torch.equal(ancestor_mask(pf, 1), mask)


# ------------------------------------------------------------- acceptance


@pytest.mark.parametrize("follow", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("budget", [1, 8, 40])
def test_accept_walk_matches_loop(follow, budget):
    n, d, v = 8, 6, 5
    tf, pf, df = random_full_trees(n, d, v, budget, seed=budget + int(10 * follow))
    g = torch.Generator().manual_seed(123)
    samples = torch.randint(0, v, tf.shape, generator=g)
    # Make samples follow a random child with probability `follow` (long paths).
    for i in range(n):
        for node in range(tf.shape[1]):
            kids = [c for c in range(1, tf.shape[1]) if int(pf[i, c]) == node]
            if kids and torch.rand(1, generator=g).item() < follow:
                c = kids[torch.randint(0, len(kids), (1,), generator=g).item()]
                samples[i, node] = tf[i, c]
    for max_depth, ancestors in [(d, None), (d + 2, None), (d, ancestor_mask(pf, d)), (d + 2, ancestor_mask(pf, d))]:
        path, num, bonus = accept_walk(tf, pf, df, samples, max_depth, ancestors)
        assert path.shape == (n, max_depth + 1) and num.shape == bonus.shape == (n,)
        for i in range(n):
            want_path, want_num, want_bonus = python_walk(
                tf[i].tolist(), pf[i].tolist(), samples[i].tolist(), max_depth)
            assert path[i].tolist() == want_path
            assert int(num[i]) == want_num
            assert int(bonus[i]) == want_bonus
    if follow == 1.0 and budget > 1:
        assert int(num.max()) >= 3  # the constructed samples do reach deep


def test_accept_walk_chain_all_accepted():
    lp = random_logprobs(2, 4, 6, 4)
    tok, par, dep = chain_tree(lp)
    tf, pf, df = with_root(torch.tensor([1, 2]), tok, par, dep)
    samples = torch.cat([tok, torch.tensor([[5], [3]])], dim=1)  # root predicts tok[0], ...
    path, num, bonus = accept_walk(tf, pf, df, samples, 4)
    assert num.tolist() == [5, 5]
    assert path.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert bonus.tolist() == [5, 3]
    samples[1, 2] = (samples[1, 2] + 1) % 6  # node 2 mispredicts node 3
    path, num, bonus = accept_walk(tf, pf, df, samples, 4)
    assert num.tolist() == [5, 3] and path[1].tolist() == [0, 1, 2, 2, 2]
    assert int(bonus[1]) == int(samples[1, 2])


def test_gather_rows_and_compaction_moves():
    n, d, v = 5, 5, 4
    tf, pf, df = random_full_trees(n, d, v, 30, seed=77)
    T = tf.shape[1]
    g = torch.Generator().manual_seed(5)
    samples = tf[torch.arange(n)[:, None], torch.randint(0, T, (n, T), generator=g)]
    # Follow the first child everywhere to get long paths.
    for i in range(n):
        for node in range(T):
            kids = [c for c in range(1, T) if int(pf[i, c]) == node]
            if kids and i % 2 == 0:
                samples[i, node] = tf[i, kids[0]]
    path, num, _ = accept_walk(tf, pf, df, samples, d)

    x = torch.randn(n, T, 3, 2, generator=g)
    rows = gather_rows(x, path)
    assert rows.shape == (n, d + 1, 3, 2)
    for i in range(n):
        for k in range(d + 1):
            assert torch.equal(rows[i, k], x[i, path[i, k]])
    assert torch.equal(gather_rows(tf, path), torch.gather(tf, 1, path))

    src, dst, needed = compaction_moves(path, num)
    assert src.shape == dst.shape == needed.shape == path.shape
    for i in range(n):
        buf = x[i].clone()
        for k in range(d + 1):
            assert int(dst[i, k]) == k and int(src[i, k]) == int(path[i, k])
            assert bool(needed[i, k]) == (k < int(num[i]) and int(path[i, k]) != k)
            # Accepted sources never lie below their destination (parents come
            # before children), so applying the moves in order of k is safe.
            if k < int(num[i]):
                assert int(src[i, k]) >= k
            if needed[i, k]:
                buf[k] = buf[src[i, k]]
        m = int(num[i])
        assert torch.equal(buf[:m], x[i, path[i, :m]])
    assert bool(needed.any())  # the test exercised real moves


# --------------------------------------------------------------- sampling


def sampling_params(n, temp=1.0, top_k=0, top_p=1.0):
    return (torch.full((n,), float(temp)), torch.full((n,), int(top_k), dtype=torch.long),
            torch.full((n,), float(top_p)))


def reference_allowed(logits_row, temp, top_k, top_p):
    """Allowed token set for one row, computed independently in float64."""
    x = logits_row.double() / temp
    order = sorted(range(len(x)), key=lambda t: (-x[t].item(), t))
    if top_k > 0:
        order = order[:top_k]
    p = torch.softmax(x[order], dim=0).tolist()
    keep, cum = [], 0.0
    for tok, pt in zip(order, p):
        keep.append(tok)
        cum += pt
        if cum >= top_p:
            break
    return set(keep)


def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 20, generator=g)
    logits[0, 0, [3, 7]] = 100.0  # tie: first max index wins
    temp, k, p = sampling_params(3, temp=0.0, top_k=5, top_p=0.5)
    out = sample_from_logits(logits, temp, k, p, None)
    assert torch.equal(out, logits.argmax(-1)) and out[0, 0].item() == 3
    # Mixed batch: only request 1 is greedy.
    temp = torch.tensor([1.0, 0.0, 0.7])
    out = sample_from_logits(logits, temp, k, p, None)
    assert torch.equal(out[1], logits[1].argmax(-1))
    probs = filtered_probs(logits, temp, k, p)
    assert torch.equal(probs[1].argmax(-1), logits[1].argmax(-1))
    assert torch.all(probs[1].max(-1).values == 1.0)


def test_top_k_one_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 30, generator=g)
    logits[2, 1, [4, 9]] = 50.0
    temp, k, p = sampling_params(4, temp=1.3, top_k=1)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = sample_from_logits(logits, temp, k, p, gens)
    assert torch.equal(out, logits.argmax(-1)) and out[2, 1].item() == 4


def test_seeded_generators_reproducible():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 16, 50, generator=g)
    temp, k, p = sampling_params(3, temp=1.0, top_k=20, top_p=0.95)

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return sample_from_logits(logits, temp, k, p, gens)

    a, b = run([1, 2, 3]), run([1, 2, 3])
    assert torch.equal(a, b)
    c = run([1, 2, 99])
    assert torch.equal(a[:2], c[:2]) and not torch.equal(a[2], c[2])
    # Mixing seeded and unseeded requests: the seeded ones still reproduce.
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(3)]
    d = sample_from_logits(logits, temp, k, p, gens)
    assert torch.equal(d[0], a[0]) and torch.equal(d[2], a[2])


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.8), (3, 0.0)])
def test_samples_inside_allowed_set(top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    n, t, v = 2, 200, 16
    logits = torch.randn(n, t, v, generator=g) * 2
    temp = torch.tensor([0.8, 1.5])
    k = torch.full((n,), top_k, dtype=torch.long)
    p = torch.full((n,), top_p)
    probs = filtered_probs(logits, temp, k, p)
    out = sample_from_logits(logits, temp, k, p, [torch.Generator().manual_seed(9)] * 1 + [None])
    for i in range(n):
        for j in range(t):
            allowed = reference_allowed(logits[i, j], temp[i].item(), top_k, top_p)
            assert int(out[i, j]) in allowed
            assert set(torch.nonzero(probs[i, j]).flatten().tolist()) == allowed
    assert torch.allclose(probs.sum(-1), torch.ones(n, t))


@pytest.mark.parametrize("seeded", [True, False])
def test_sampling_frequencies_chisquare(seeded):
    v, rows = 10, 4000
    g = torch.Generator().manual_seed(3)
    base = torch.randn(v, generator=g) * 1.5
    logits = base.expand(2, rows, v).clone()
    temp = torch.tensor([0.9, 1.2])
    k = torch.tensor([7, 0])
    p = torch.tensor([0.95, 0.9])
    probs = filtered_probs(logits, temp, k, p)[:, 0].double()
    with torch.random.fork_rng():
        torch.manual_seed(2024)
        gens = [torch.Generator().manual_seed(2024 + i) for i in range(2)] if seeded else None
        out = sample_from_logits(logits, temp, k, p, gens)
    for i in range(2):
        counts = torch.bincount(out[i], minlength=v).double()
        support = probs[i] > 0
        assert counts[~support].sum() == 0
        assert int(support.sum()) >= 3  # a non-trivial distribution
        expected = probs[i, support] / probs[i, support].sum() * rows
        stat = chisquare(counts[support].numpy(), expected.numpy())
        assert stat.pvalue > 1e-3


def test_top_p_boundary_exact():
    # Equal logits give exactly representable probabilities: the nucleus is the
    # smallest set whose mass reaches p, so reaching p exactly stops there.
    logits = torch.full((1, 1, 6), float("-inf"))
    logits[0, 0, [1, 2, 4, 5]] = 0.0  # four tokens, 0.25 each
    temp = torch.tensor([1.0])
    probs = filtered_probs(logits, temp, torch.tensor([0]), torch.tensor([0.5]))
    assert probs[0, 0].tolist() == [0.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    probs = filtered_probs(logits, temp, torch.tensor([2]), torch.tensor([0.5]))
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    probs = filtered_probs(logits, temp, torch.tensor([0]), torch.tensor([0.51]))
    assert torch.allclose(probs[0, 0], torch.tensor([0.0, 1 / 3, 1 / 3, 0.0, 1 / 3, 0.0]))


def test_filters_off_is_plain_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 12, generator=g)
    temp = torch.tensor([0.5, 2.0])
    probs = filtered_probs(logits, temp, torch.tensor([0, 12]), torch.tensor([1.0, 1.0]))
    assert torch.allclose(probs, torch.softmax(logits / temp[:, None, None], -1))
    assert bool((probs > 0).all())


# ------------------------------------------------------------- host syncs


def test_batched_builder_static_shapes_and_no_sync_calls():
    n, d, v, budget = 3, 5, 8, 20
    inputs = [
        random_logprobs(n, d, v, 0),
        tie_logprobs(n, d, v, 1, levels=2),
        tie_logprobs(n, d, v, 2, levels=3, neg_inf_frac=0.7),
        torch.log_softmax(torch.zeros(n, d, v), -1),
    ]
    shapes = {tuple(x.shape) for lp in inputs for x in build_tree_batched(lp, budget)}
    assert shapes == {(n, effective_budget(budget, d, v))}

    import ddtree.tree.accept as accept_mod
    import ddtree.tree.build as build_mod
    import ddtree.tree.layout as layout_mod

    no_sync_fns = [build_mod.build_tree_batched, build_mod.topk_per_depth, build_mod.chain_tree,
                   layout_mod.with_root, layout_mod.ancestor_mask, layout_mod.positions,
                   accept_mod.accept_walk, accept_mod.gather_rows, accept_mod.compaction_moves]
    for fn in no_sync_fns:
        src = inspect.getsource(fn)
        for bad in (".item(", ".tolist(", ".cpu(", "nonzero"):
            assert bad not in src, (fn.__name__, bad)


def test_tree_package_imports_only_torch_and_stdlib():
    import ast
    import sys

    import ddtree.tree as pkg
    import ddtree.tree.accept as a
    import ddtree.tree.build as b
    import ddtree.tree.layout as lay

    for mod in (pkg, a, b, lay):
        tree = ast.parse(inspect.getsource(mod))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [al.name for al in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    continue  # relative import inside ddtree.tree
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top == "torch" or top in sys.stdlib_module_names, (mod.__name__, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_on_cuda_matches_heap():
    lp = tie_logprobs(4, 5, 9, 11, levels=3)
    for budget in [1, 8, 33]:
        tok, par, dep = build_tree_batched(lp.cuda(), budget)
        assert tok.device.type == "cuda"
        for i in range(4):
            h = build_tree_heap(lp[i], budget)
            assert torch.equal(tok[i].cpu(), h[0]) and torch.equal(par[i].cpu(), h[1])
            assert torch.equal(dep[i].cpu(), h[2])


def test_topk_cpu_path_equals_key_selection():
    """The CPU shortcut (topk of k+1, exact fallbacks for ties across the cut and NaN) returns
    the same ids and value bits as the int64-key selection the GPU runs, on tie-heavy inputs."""
    import ddtree.tree.build as build_mod
    g = torch.Generator().manual_seed(0)
    for trial in range(120):
        rows, vocab = int(torch.randint(1, 30, (), generator=g)), int(torch.randint(2, 400, (), generator=g))
        x = torch.randn(rows, vocab, generator=g)
        if trial % 3 == 0:  # many ties, also across the cut
            x = torch.randint(-3, 1, (rows, vocab), generator=g).float()
        if trial % 4 == 0:
            x[x > 0.5] = float("-inf")
        if trial % 5 == 0:  # -0.0 and +0.0 tie
            x = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
        if trial % 7 == 0:
            x[0, 0] = float("nan")
        if trial % 2:
            x = torch.log_softmax(x, dim=-1)
        for k in {1, 2, 8, 16, vocab - 1}:
            if not 0 < k < vocab:
                continue
            got, want = topk_per_depth(x, k), build_mod._topk_select(x, k)
            assert torch.equal(got[1], want[1])
            assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))


@pytest.mark.parametrize("budget", [1, 2, 5, 8])
def test_a_tree_never_reads_depths_past_its_budget(budget):
    """A depth-d node has d - 1 ancestors, so depths past the budget cannot be in the tree: the
    vLLM proposer computes drafter logits only for the first min(budget, depth) positions."""
    for lp in (random_logprobs(3, 15, 30, seed=budget), tie_logprobs(3, 15, 9, seed=budget, levels=2)):
        full = build_tree_batched(lp, budget)
        cut = build_tree_batched(lp[:, :budget], budget)
        for a, b in zip(full, cut):
            assert torch.equal(a, b)
        assert int(full[2].max()) <= budget
