"""Target-side sampling at every tree node and the lossless acceptance walk.

The target model is run once over the whole tree; every node i gets one
sample ``samples[i]`` from the target distribution at that node.  A child c
of node i is accepted iff ``tokens[c] == samples[i]``: walking down from the
root this way commits exactly the tokens the target would have sampled
itself, so the output distribution is unchanged (lossless).
"""

import torch

__all__ = [
    "filtered_probs",
    "sample_from_logits",
    "accept_walk",
    "gather_rows",
    "compaction_moves",
]


def _cpu_all(cond: torch.Tensor) -> bool:
    # True only when it can be known without a device sync (CPU tensor).
    return cond.device.type == "cpu" and bool(cond.all())


def _filters_off(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> bool:
    return _cpu_all((top_k <= 0) | (top_k >= vocab)) and _cpu_all(top_p >= 1.0)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The fp32 distribution ``sample_from_logits`` draws from, [N, T, V].

    softmax(logits / temperature) restricted to the top-k tokens (ties: the
    smaller token id wins, so exactly k survive) and then to the smallest set
    of most probable tokens whose cumulative probability (renormalised after
    top-k) reaches top_p; at least one token is always kept.  top_k <= 0 and
    top_p >= 1 switch the filters off.  Rows with temperature <= 0 get a
    one-hot at the argmax (greedy).
    """
    N, T, V = logits.shape
    device = logits.device
    x = logits.float()
    temp = temperature.to(device=device, dtype=torch.float32)
    greedy = temp <= 0
    x = x / torch.where(greedy, torch.ones_like(temp), temp)[:, None, None]

    if not _filters_off(top_k, top_p, V):
        k = top_k.to(device=device, dtype=torch.long)
        k = torch.where(k > 0, k, torch.full_like(k, V))
        p = top_p.to(device=device, dtype=torch.float32)
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=device)
        keep = (rank[None, None, :] < k[:, None, None]).expand(N, T, V)
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        # Probability mass strictly before each token; a token is kept while
        # the mass before it is still short of p (so the first always is).
        before = torch.cumsum(probs, dim=-1) - probs
        nucleus = (before < p[:, None, None]) | (p[:, None, None] >= 1.0)
        nucleus[..., 0] = True
        keep = keep & nucleus
        keep_vocab = torch.zeros_like(keep).scatter_(-1, order, keep)
        x = x.masked_fill(~keep_vocab, float("-inf"))

    probs = torch.softmax(x, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None, None], one_hot, probs)


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor,
                       generators=None, all_greedy: bool | None = None,
                       use_filters: bool | None = None) -> torch.Tensor:
    """One target sample per node, LongTensor [N, T].

    Rows of requests with temperature <= 0 take the argmax (first max
    index).  Others draw from ``filtered_probs`` by an exponential race
    (argmax of p / E with E ~ Exp(1), the same law as multinomial) so no
    host sync or data-dependent shape is involved and CUDA graphs can
    capture it; request n uses ``generators[n]`` when given.
    ``all_greedy`` / ``use_filters`` state what the caller knows about the
    batch; None derives it from the parameters when they are CPU tensors.
    """
    N, T, V = logits.shape
    greedy_tok = torch.argmax(logits, dim=-1)
    if all_greedy is None:
        all_greedy = _cpu_all(temperature <= 0)
    if all_greedy:  # skip the softmax entirely
        return greedy_tok
    if use_filters is None:
        use_filters = not _filters_off(top_k, top_p, V)
    if use_filters:
        probs = filtered_probs(logits, temperature, top_k, top_p)
    else:
        probs = filtered_probs(logits, temperature, torch.zeros_like(top_k, device="cpu"),
                               torch.ones_like(top_p, device="cpu"))
    race = torch.empty_like(probs)
    if generators is None or all(g is None for g in generators):
        race.exponential_()
    else:
        if len(generators) != N:
            raise ValueError(f"need one generator slot per request: {len(generators)} != {N}")
        for n, g in enumerate(generators):
            race[n].exponential_(generator=g)
    sampled = torch.argmax(probs / race.clamp_(min=torch.finfo(torch.float32).tiny), dim=-1)
    greedy = (temperature.to(logits.device) <= 0)[:, None]
    return torch.where(greedy, greedy_tok, sampled)


def accept_walk(tokens_full: torch.Tensor, parents_full: torch.Tensor,
                depths_full: torch.Tensor, samples: torch.Tensor, max_depth: int,
                ancestors: torch.Tensor | None = None):
    """Longest accepted root path, vectorised, no host syncs.

    A node is alive when it and every ancestor below the root match the
    target's sample at their parent (tokens[i] == samples[parent[i]]).
    Sibling tokens are distinct so alive nodes form one chain; its deepest
    node ends the path.  With ``ancestors`` (the [N, T, T] ancestor mask of
    the verify pass) this is a handful of batched ops; without it, parent
    pointers are followed ``max_depth`` times.

    Returns ``(path [N, max_depth+1], num_accepted [N], bonus [N])``:
    path[n, k] = accepted node at depth k for k < num_accepted[n] (then the
    last accepted node repeats); num_accepted counts the root; bonus is the
    target sample at the last accepted node.
    """
    N, T = tokens_full.shape
    device = tokens_full.device
    match = tokens_full == torch.gather(samples, 1, parents_full)
    match[:, 0] = True  # the root matches nothing but is always accepted
    if ancestors is not None:
        alive = ~(ancestors & ~match[:, None, :]).any(-1)
    else:
        alive = torch.zeros(N, T, dtype=torch.bool, device=device)
        alive[:, 0] = True
        for _ in range(max_depth):
            alive = match & torch.gather(alive, 1, parents_full)
            alive[:, 0] = True

    alive_depth = torch.where(alive, depths_full, torch.full_like(depths_full, -1))
    last_depth, last = alive_depth.max(dim=1)  # at most one alive node per depth
    num_accepted = last_depth + 1

    k = torch.arange(max_depth + 1, device=device)
    if ancestors is not None:
        # The path is the last node's ancestor row; put each node at its depth.
        on_path = torch.gather(ancestors, 1, last[:, None, None].expand(N, 1, T)).squeeze(1)
        slot = torch.where(on_path, depths_full, torch.full_like(depths_full, max_depth + 1))
        nodes = torch.arange(T, device=device).expand(N, T)
        path = torch.zeros(N, max_depth + 2, dtype=torch.long, device=device).scatter_(1, slot, nodes)
        path = torch.where(k[None, :] <= last_depth[:, None], path[:, :max_depth + 1], last[:, None])
    else:
        anc = [last]  # anc[:, i] is i steps above the last node
        for _ in range(max_depth):
            anc.append(torch.gather(parents_full, 1, anc[-1][:, None]).squeeze(1))
        anc = torch.stack(anc, dim=1)  # [N, max_depth+1]
        steps_up = (last_depth[:, None] - k[None, :]).clamp(min=0)  # past the end -> 0 = last
        path = torch.gather(anc, 1, steps_up)
    bonus = torch.gather(samples, 1, last[:, None]).squeeze(1)
    return path, num_accepted, bonus


def gather_rows(x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``x[n, path[n, k], ...]`` for every n, k: [N, T, ...] -> [N, L, ...]."""
    N, L = path.shape
    idx = path.reshape(N, L, *([1] * (x.dim() - 2))).expand(N, L, *x.shape[2:])
    return torch.gather(x, 1, idx)


def compaction_moves(path: torch.Tensor, num_accepted: torch.Tensor):
    """KV-cache compaction plan: move node offset ``src`` to offset ``dst``.

    Accepted node k (at node offset path[n, k]) must end at offset k; a move
    is needed where k < num_accepted[n] and it is not already there.
    Returns ``(src, dst, needed)``, each [N, L].
    """
    N, L = path.shape
    dst = torch.arange(L, device=path.device).expand(N, L)
    needed = (dst < num_accepted[:, None]) & (path != dst)
    return path, dst.clone(), needed
