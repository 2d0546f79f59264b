"""Logits processing (allowed_token_ids, bad_words, min_tokens, logit_bias, repetition / frequency /
presence penalties, min_p) for every node of a verified tree, so that node i's distribution is
exactly what plain decoding would sample after the prefix that ends at node i: the committed
tokens plus node i's path.

The order is vLLM's: the allowed_token_ids and bad_words masks, min_tokens and logit_bias, then
the penalties, then min_p (which vLLM applies
after temperature: p_i < min_p * p_max is x_i < max(x) + T * ln(min_p) on the logits before
temperature, so it is a mask here and sampling's temperature and top-k / top-p follow). A bad
word's last token is masked where the output tokens before it (vLLM matches output tokens only)
end with the word's other tokens; for a tree node those are the committed output tokens plus
the node's path. Penalties count output
tokens; each node adds the tokens on its own path below the root (the root, the last committed
token, is already counted). Only the tokens in a tree can have counts that differ from the
committed ones, so those are recomputed per (node, tree token) pair instead of building
[N, T, V] counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Processing:
    """Per-request state of the committed prefix, on the logits' device, for the batch rows
    ``rows`` (the requests that process their logits)."""
    counts: torch.Tensor        # [N, V] float: occurrences of each token among the output tokens
    seen: torch.Tensor          # [N, V] bool: the token is in the prompt or the output
    bias: torch.Tensor          # [N, V] float: logit_bias
    repetition: torch.Tensor    # [N] float (1 = off)
    frequency: torch.Tensor     # [N] float
    presence: torch.Tensor      # [N] float
    min_left: torch.Tensor      # [N] long: output tokens still needed before a stop token may come
    stop_tokens: torch.Tensor   # [N, V] bool: EOS and stop_token_ids (blocked while min_left > depth)
    rows: torch.Tensor          # [N] long
    min_p_shift: torch.Tensor   # [N] float: T * ln(min_p) (-inf = off): tokens below max + shift go
    bad_words: list[list[list[int]]]  # per row: token sequences whose last token is masked after the rest
    tails: torch.Tensor         # [N, L] long: the last L output tokens (-1 where fewer), L = longest bad word - 1

    @classmethod
    def build(cls, outputs: list[list[int]], prompts: list[list[int]], biases: list[dict[int, float] | None],
              repetition: list[float], frequency: list[float], presence: list[float], min_left: list[int],
              stop_tokens: list[list[int]], vocab: int, device, rows: list[int] | None = None,
              min_p: list[float] | None = None, temperature: list[float] | None = None,
              allowed: list[list[int] | None] | None = None,
              bad_words: list[list[list[int]] | None] | None = None) -> "Processing":
        """min_p with each row's sampling temperature (min_p has no effect on greedy rows);
        allowed: the only tokens a row may sample (None: any); bad_words: token sequences per row."""
        N = len(outputs)
        counts = torch.zeros(N, vocab)
        seen = torch.zeros(N, vocab, dtype=torch.bool)
        bias = torch.zeros(N, vocab)
        stops = torch.zeros(N, vocab, dtype=torch.bool)
        for n in range(N):
            out = torch.tensor(outputs[n], dtype=torch.long)
            counts[n].index_add_(0, out, torch.ones(len(out)))
            seen[n, out] = True
            seen[n, torch.tensor(prompts[n], dtype=torch.long)] = True
            if biases[n]:
                bias[n, torch.tensor(list(biases[n]), dtype=torch.long)] = torch.tensor(list(biases[n].values()))
            stops[n, torch.tensor(stop_tokens[n], dtype=torch.long)] = True
            if allowed is not None and allowed[n] is not None:
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[torch.tensor(allowed[n], dtype=torch.long)] = True
                bias[n].masked_fill_(~keep, float("-inf"))
        words = [list(w or []) for w in bad_words] if bad_words is not None else [[] for _ in range(N)]
        L = max((len(w) - 1 for ws in words for w in ws), default=0)
        tails = torch.full((N, L), -1, dtype=torch.long)
        for n in range(N):
            tail = outputs[n][len(outputs[n]) - L:] if L else []
            tails[n, L - len(tail):] = torch.tensor(tail, dtype=torch.long)
        f = dict(dtype=torch.float32)
        return cls(counts.to(device), seen.to(device), bias.to(device), torch.tensor(repetition, **f).to(device),
                   torch.tensor(frequency, **f).to(device), torch.tensor(presence, **f).to(device),
                   torch.tensor(min_left, dtype=torch.long).to(device), stops.to(device),
                   torch.tensor(range(N) if rows is None else rows, dtype=torch.long).to(device),
                   torch.tensor([min_p_shift(m, t) for m, t in zip(min_p or [0.0] * N, temperature or [0.0] * N)],
                                **f).to(device), words, tails.to(device))


def min_p_shift(min_p: float, temperature: float) -> float:
    return temperature * math.log(min_p) if min_p > 0 and temperature > 0 else float("-inf")


def _mask_bad_words(x, tokens, depths, ancestors, p: Processing) -> torch.Tensor:
    """Masks each bad word's last token at the nodes whose output tokens end with its others."""
    N, T, _ = x.shape
    L = p.tails.shape[1]
    # context[n, i]: the last L committed output tokens, then node i's path tokens below the
    # root (depth j at column L - 1 + j; -1 past the node's depth)
    if ancestors is None or T == 1:
        context = p.tails[:, None, :].expand(N, T, L)
    else:
        at_depth = (depths[:, :, None] == torch.arange(1, T, device=x.device)).float()   # [N, T(a), T-1]
        below = torch.bmm(ancestors.float(), at_depth * (tokens[:, :, None] + 1).float())  # exact: ids < 2^24
        context = torch.cat([p.tails[:, None, :].expand(N, T, L), below.long() - 1], 2)
    x = x.clone()
    for n, words in enumerate(p.bad_words):
        for word in words:
            m = len(word) - 1
            if m == 0:
                match = torch.ones(T, dtype=torch.bool, device=x.device)
            else:  # node i's last m output tokens are columns L + depth - m .. L + depth - 1
                cols = L + depths[n, :, None] - m + torch.arange(m, device=x.device)
                match = (context[n].gather(1, cols) == torch.tensor(word[:-1], device=x.device)).all(1)
            x[n, :, word[-1]] = x[n, :, word[-1]].masked_fill(match, float("-inf"))
    return x


def _penalize(x, counts, seen, repetition, frequency, presence):
    """vLLM's penalties: repetition divides positive / multiplies negative logits of seen tokens;
    frequency and presence subtract per occurrence / once for output tokens."""
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


def process_tree_logits(logits: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                        ancestors: torch.Tensor | None, p: Processing) -> torch.Tensor:
    """logits [N, T, V] (raw target logits at every node, root first) -> processed logits.
    tokens / depths [N, T]; ancestors [N, T, T] bool (node j is node i or an ancestor; None: the
    root alone)."""
    N, T, V = logits.shape
    x = logits.float() + p.bias[:, None, :]
    blocked = (depths < p.min_left[:, None])[:, :, None] & p.stop_tokens[:, None, :]
    x = x.masked_fill(blocked, float("-inf"))
    if any(p.bad_words):
        x = _mask_bad_words(x, tokens, depths, ancestors, p)
    if ancestors is None or T == 1:
        pre_path = None
    else:
        path = ancestors.clone()
        path[:, :, 0] = False  # the root is committed: already in counts / seen
        # (node i, ancestor j) pairs: token tokens[j] occurs on i's path this many times
        same = (tokens[:, :, None] == tokens[:, None, :]).float()       # [N, T(k), T(j)]
        on_path = torch.bmm(path.float(), same)                           # [N, T(i), T(j)]
        idx = tokens[:, None, :].expand(N, T, T)                          # token of pair (i, j)
        pre_path = x.gather(2, idx)                                       # before penalties
    r, f, pr = (v[:, None, None] for v in (p.repetition, p.frequency, p.presence))
    out = _penalize(x, p.counts[:, None, :], p.seen[:, None, :], r, f, pr)
    if pre_path is not None:
        # on_path[i, j] counts token tokens[j] on i's path whether or not j is on it, so every
        # pair naming the same token writes the same value (scatter with duplicates is safe)
        total = p.counts.gather(1, tokens)[:, None, :] + on_path          # [N, T(i), T(j)]
        seen = p.seen.gather(1, tokens)[:, None, :] | (on_path > 0)
        out = out.scatter(2, idx, _penalize(pre_path, total, seen, r, f, pr))
    return out.masked_fill(out < out.amax(-1, keepdim=True) + p.min_p_shift[:, None, None], float("-inf"))
