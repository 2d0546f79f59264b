"""Draft-tree construction for DDTree.

Given per-depth drafter log-probabilities ``logprobs[D, V]`` (row d-1 holds
depth d), the DDTree tree is the set of the ``budget`` best prefixes, where
the score of a prefix u = (u_1..u_d) is sum_i logprobs[i-1, u_i].  Because
log-probabilities are <= 0 a child never outscores its parent, so the top-B
set is prefix-closed (a valid tree).

Tie rule (shared by both builders, which must agree bit for bit):

1. Per depth, tokens are ranked by a stable descending sort (equal values:
   smaller token id first); only the top K = min(B, V) ranks are used.
2. Scores are fp32 and always computed as ``parent_score + lp`` (root 0.0).
3. Prefixes are totally ordered by: higher score; then smaller depth; then
   the parent that comes earlier in this same order; then smaller rank.
4. Output nodes follow this order, which is topological.

Node convention of the builders' outputs: output node j (0-based) is tree
node j+1; ``parents[j]`` is 0 for the root, p > 0 for output node p-1;
``depths[j]`` is in 1..D.
"""

import heapq

import torch

__all__ = [
    "effective_budget",
    "topk_per_depth",
    "build_tree_heap",
    "build_tree_batched",
    "chain_tree",
]


def effective_budget(budget: int, depth: int, vocab: int) -> int:
    """Number of nodes a tree of ``budget`` can actually have.

    = min(budget, sum_{d=1..depth} K^d) with K = min(budget, vocab); the
    geometric sum is accumulated only until it reaches ``budget`` so it never
    grows huge.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if depth < 0 or vocab < 0:
        raise ValueError(f"depth and vocab must be >= 0, got {depth}, {vocab}")
    k = min(budget, vocab)
    total, power = 0, 1
    for _ in range(depth):
        power *= k
        total += power
        if total >= budget:
            return budget
    return total


def _topk_per_depth_reference(logprobs: torch.Tensor, k: int):
    """Definition of :func:`topk_per_depth`: full stable descending sort."""
    vals, idx = torch.sort(logprobs.float(), dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _topk_select(x: torch.Tensor, k: int):
    """Exact stable top-``k`` of float32 ``x`` along the last dim, 0 < k <= V.

    Same result as the full stable sort, with one ``torch.topk`` and no host
    syncs: every entry gets a unique int64 key whose order is (value desc,
    index asc) -- the fp32 bits mapped to an order-preserving int32 in the
    high half, V-1-index in the low half -- so selecting the k largest keys
    selects and orders exactly like the sort.  ``x + 0.0`` maps -0.0 to
    +0.0, which the sort treats as equal; values are gathered from ``x`` so
    their bits match the sort's output.
    """
    V = x.shape[-1]
    bits = (x + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    low = torch.arange(V - 1, -1, -1, device=x.device, dtype=torch.int64)
    key = ordered * (1 << 32) + low
    top = torch.topk(key, k, dim=-1, sorted=True).values
    idx = (V - 1) - (top & 0xFFFFFFFF)
    return x.gather(-1, idx), idx


def _topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_topk_select` for a CPU float32 ``x [R, V]`` (0 < k < V), computed faster.

    Same values and token ids, same tie rule (value descending, then smaller token id). The
    sync-free int64-key selection (keys over the whole vocabulary) dominates a CPU step (14.5 vs
    1.1 ms per vLLM plugin step); on CPU host checks cost nothing, so one ``torch.topk`` of k+1
    does the work. When no row has a tie across the cut
    (k-th == (k+1)-th value), its first k are exactly the top-k set and only their order among
    equal values needs fixing (a stable sort of k entries). Otherwise every entry at or above the
    k-th value is ordered exactly (``_top_k_threshold``); NaN takes the reference path.
    """
    vals, ids = torch.topk(x, k + 1, dim=-1)  # descending; order among equal values unspecified
    if bool(torch.isnan(vals).any()):  # topk ranks NaN first, so a NaN anywhere shows here
        return _topk_select(x, k)
    if bool((vals[:, k - 1] == vals[:, k]).any()):
        return _top_k_threshold(x, k)
    ids, by_id = ids[:, :k].sort(dim=-1)
    vals, by_val = vals[:, :k].gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, by_val)


def _top_k_threshold(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k when ties straddle the cut: order all entries >= each row's k-th value."""
    R = x.shape[0]
    kth = torch.topk(x, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    rows, cols = (x >= kth).nonzero(as_tuple=True)  # row-major: ids ascending within a row
    vals = x[rows, cols]
    # Stable: by value (descending) and then by row, so a row's entries stay (value desc, id asc).
    order = torch.sort(vals, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    counts = torch.bincount(rows, minlength=R)
    first = torch.cumsum(counts, 0) - counts
    take = order[first[:, None] + torch.arange(k)[None, :]]
    return vals[take], cols[take]


def topk_per_depth(logprobs: torch.Tensor, k: int):
    """Top-``k`` log-probs and token ids along the last dim, stable descending.

    Exactly the first ``k`` entries of a stable descending sort (equal values:
    smaller token id first), but computed by one selection (``torch.topk``)
    over unique integer keys instead of a full sort over the vocabulary;
    see :func:`_topk_select`.  No host syncs, static shapes (on CPU, where there
    are no graphs, :func:`_topk_cpu` trades a few host checks for speed).
    Returns ``(lp float32 [..., k], tok int64 [..., k])``.
    """
    x = logprobs.float()
    V = x.shape[-1]
    if k <= 0 or k >= V:
        # Nothing to select (k >= V is a full sort anyway).
        return _topk_per_depth_reference(x, k)
    if x.device.type == "cpu":
        vals, ids = _topk_cpu(x.reshape(-1, V), k)
        return vals.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)
    return _topk_select(x, k)


def _empty_tree(n: int, device) -> tuple:
    e = torch.empty(n, 0, dtype=torch.long, device=device)
    return e, e.clone(), e.clone()


def _f32_add(a: float, b: float) -> float:
    # Heap scores are Python floats holding exact fp32 values; the addition
    # itself is done in fp32 so it matches the batched builder bit for bit.
    t = torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)
    return t.item()


def build_tree_heap(logprobs: torch.Tensor, budget: int):
    """Reference builder for ONE request (``logprobs[D, V]``), best-first heap.

    Heap key (-score, depth, parent_output_index, rank) realises the tie
    rule: popping is monotone because a child / next sibling never precedes
    the node that pushes it.
    Returns ``(tokens, parents, depths)``, LongTensors of length B' on CPU.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [D, V], got shape {tuple(logprobs.shape)}")
    D, V = logprobs.shape
    n_nodes = effective_budget(budget, D, V)
    if n_nodes == 0:
        tok, par, dep = _empty_tree(1, "cpu")
        return tok[0], par[0], dep[0]
    K = min(budget, V)
    lp, tok = topk_per_depth(logprobs.detach().cpu(), K)
    # Defensive clamp: prefix-closure needs children never to outscore parents.
    lp = lp.clamp(max=0.0).tolist()
    tok = tok.tolist()

    out_tok, out_par, out_dep, out_score = [], [], [], []
    # Entries: (-score, depth, parent_output_index (root = -1), rank).
    heap = [(-_f32_add(0.0, lp[0][0]), 1, -1, 0)]
    while heap and len(out_tok) < n_nodes:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        score = -neg_score
        me = len(out_tok)
        out_tok.append(tok[depth - 1][rank])
        out_par.append(parent + 1)
        out_dep.append(depth)
        out_score.append(score)
        parent_score = 0.0 if parent < 0 else out_score[parent]
        if rank + 1 < K:  # next sibling
            s = _f32_add(parent_score, lp[depth - 1][rank + 1])
            heapq.heappush(heap, (-s, depth, parent, rank + 1))
        if depth < D:  # first child
            s = _f32_add(score, lp[depth][0])
            heapq.heappush(heap, (-s, depth + 1, me, 0))

    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_long(out_tok), as_long(out_par), as_long(out_dep)


def build_tree_batched(logprobs: torch.Tensor, budget: int):
    """Batched builder (``logprobs[N, D, V]``) with no host syncs.

    Per depth d keeps a beam of the best n_d depth-d prefixes in the global
    order; n_d depends only on (budget, K, d), so every shape is static.
    beam_d is built from all (beam_{d-1} entry j, rank r) pairs flattened as
    j*K + r and stably sorted by score: since beam_{d-1} is already in the
    global order this breaks ties by (parent order, rank) as required.  The
    beams are then concatenated in depth order and stably sorted once more
    (equal score -> smaller depth -> earlier beam position); the first B'
    entries are the tree.
    Returns ``(tokens, parents, depths)``, each LongTensor [N, B'] on the
    input's device.
    """
    if logprobs.dim() != 3:
        raise ValueError(f"logprobs must be [N, D, V], got shape {tuple(logprobs.shape)}")
    N, D, V = logprobs.shape
    device = logprobs.device
    n_nodes = effective_budget(budget, D, V)
    if n_nodes == 0:
        return _empty_tree(N, device)
    K = min(budget, V)
    lp, tok = topk_per_depth(logprobs, K)
    lp = lp.clamp(max=0.0)  # same defensive clamp as the heap builder

    # Depth 1: the K candidates, already sorted (K <= budget).
    beam_score = [lp[:, 0, :]]
    beam_tok = [tok[:, 0, :]]
    beam_parent = [torch.zeros(N, K, dtype=torch.long, device=device)]  # unused
    sizes = [K]
    for d in range(1, D):
        # A depth-(d+1) tree node needs d ancestors in the tree, so at most
        # budget - d such nodes can be in it: a smaller beam is enough.
        n_prev = sizes[-1]
        n_d = min(budget - d, n_prev * K)
        if n_d <= 0:
            break
        cand = beam_score[-1][:, :, None] + lp[:, d, None, :]  # [N, n_prev, K]
        score, idx = torch.sort(cand.reshape(N, n_prev * K), dim=1,
                                descending=True, stable=True)
        score, idx = score[:, :n_d], idx[:, :n_d]
        beam_score.append(score)
        beam_tok.append(torch.gather(tok[:, d, :], 1, idx % K))
        beam_parent.append(idx // K)  # position in beam_{d-1}
        sizes.append(n_d)

    # Offsets of each depth's beam inside the concatenation.
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    total = offsets[-1] + sizes[-1]

    all_score = torch.cat(beam_score, dim=1)  # [N, total]
    all_tok = torch.cat(beam_tok, dim=1)
    # Parent as a position in the concatenation (depth 1: dummy 0, masked later).
    all_parent = torch.cat(
        [beam_parent[0]] + [p + offsets[i - 1] for i, p in enumerate(beam_parent) if i > 0],
        dim=1,
    )
    all_depth = torch.cat(
        [torch.full((N, s), i + 1, dtype=torch.long, device=device) for i, s in enumerate(sizes)],
        dim=1,
    )

    _, order = torch.sort(all_score, dim=1, descending=True, stable=True)
    sel = order[:, :n_nodes]  # concat positions of the output nodes, in order
    # inv[n, c] = output index of concat position c (>= n_nodes if not selected).
    ar = torch.arange(total, device=device).expand(N, total)
    inv = torch.empty_like(order).scatter_(1, order, ar)

    tokens = torch.gather(all_tok, 1, sel)
    depths = torch.gather(all_depth, 1, sel)
    parent_pos = torch.gather(all_parent, 1, sel)
    parent_out = torch.gather(inv, 1, parent_pos)
    parents = torch.where(depths == 1, torch.zeros_like(parent_out), parent_out + 1)
    return tokens, parents, depths


def chain_tree(logprobs: torch.Tensor):
    """DFlash chain: the path of per-depth argmax tokens (first max index) of ``logprobs``
    [N, D, V], or those tokens [N, D] already taken (int64, e.g. by a fused LM head).

    Returns ``(tokens, parents, depths)``, each LongTensor [N, D], with
    ``parents[:, j] = j`` and ``depths[:, j] = j + 1``.
    """
    if logprobs.dim() == 2 and not logprobs.is_floating_point():
        tokens = logprobs
    elif logprobs.dim() == 3:
        tokens = torch.argmax(logprobs, dim=-1)
    else:
        raise ValueError(f"logprobs must be [N, D, V] (or argmax tokens [N, D]), got shape {tuple(logprobs.shape)}")
    N, D = tokens.shape
    device = tokens.device
    ar = torch.arange(D, dtype=torch.long, device=device)
    parents = ar.expand(N, D).clone()
    depths = (ar + 1).expand(N, D).clone()
    return tokens, parents, depths
