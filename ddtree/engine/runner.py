"""Runs the models for one engine step. A decode round reads like the DDTree reference:
draft -> build -> verify -> accept -> commit, one named method each. ``ar`` is the same round
with an empty tree and ``dflash`` with a chain of the drafter's argmax tokens."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ddtree.context import AttentionContext, slots_for
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.sequence import Sequence
from ddtree.models.decoder import DecoderLM
from ddtree.models.dflash import DFlashDrafter
from ddtree.tree import (accept_walk, ancestor_mask, build_tree_batched, chain_tree, compaction_moves,
                         gather_rows, sample_from_logits, with_root)
from ddtree.tree import positions as node_positions

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class Tree:
    tokens: torch.Tensor   # [N, T] root at 0
    parents: torch.Tensor  # [N, T]
    depths: torch.Tensor   # [N, T]
    max_depth: int

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


@dataclass
class Accepted:
    path: torch.Tensor          # [N, max_depth+1] node indices, root first
    num_accepted: torch.Tensor  # [N] nodes on the path incl. root = tokens committed
    bonus: torch.Tensor         # [N]


class StageTimer:
    """Wall time per stage (on CUDA it synchronises, so use it for breakdowns, not for speed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                if timer.device.type == "cuda":
                    torch.cuda.synchronize(timer.device)
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                if timer.device.type == "cuda":
                    torch.cuda.synchronize(timer.device)
                timer.totals[name] += time.perf_counter() - self.t0

        return _Span()


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter, blocks: BlockManager, device: torch.device,
                 dtype: torch.dtype):
        self.target, self.drafter = target, drafter
        self.blocks, self.device, self.dtype = blocks, device, dtype
        self.timer = StageTimer(device)
        num_slots = blocks.num_blocks * blocks.block_size
        self.target_kv = self._alloc_kv(target.kv_shape(), num_slots)
        self.drafter_kv = []
        if isinstance(drafter, DFlashDrafter):
            self.drafter_kv = self._alloc_kv(drafter.kv_shape(), num_slots)
        self.taps = tuple(getattr(drafter, "taps", ()))

    def _alloc_kv(self, shape, num_slots):
        layers, heads, dim = shape
        return [(torch.zeros(num_slots, heads, dim, device=self.device, dtype=self.dtype),
                 torch.zeros(num_slots, heads, dim, device=self.device, dtype=self.dtype))
                for _ in range(layers)]

    def lookahead(self, method: str, budget: int) -> int:
        """Cache slots a decode step writes past the committed prefix (root + tree nodes)."""
        if method == "ar":
            return 1
        if method == "dflash":
            return self.drafter.block_size
        return budget + 1

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    # ---- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunks: list[int]) -> None:
        """Run the target over uncached prompt tokens (never the last one: it is the first root)."""
        ids, pos = [], []
        for seq, n in zip(seqs, chunks):
            a, b = seq.num_cached, seq.num_cached + n
            ids += seq.token_ids[a:b]
            pos += range(a, b)
        ctx = AttentionContext.build(self._block_tables(seqs), [s.num_cached for s in seqs], chunks,
                                     self.blocks.block_size)
        positions = self._tensor(pos)
        with self.timer("prefill"):
            _, taps = self.target(self._tensor(ids), positions, self.target_kv, ctx, self.taps)
            if self.drafter_kv:
                self.drafter.store_context(taps, positions, self.drafter_kv, ctx.slot_mapping)
        for seq, n in zip(seqs, chunks):
            seq.num_cached += n

    # ---- one decode round --------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], method: str, budget: int) -> list[list[int]]:
        """One verify round for every sequence; returns the tokens each one commits."""
        roots = self._tensor([s.token_ids[-1] for s in seqs])
        starts = [len(s) - 1 for s in seqs]
        with self.timer("draft"):
            logprobs = self.draft(seqs, roots, starts, method)
        with self.timer("build"):
            tree = self.build(roots, logprobs, method, budget)
        with self.timer("verify"):
            logits, taps, slots = self.verify(seqs, starts, tree)
        with self.timer("accept"):
            accepted = self.accept(seqs, tree, logits)
        with self.timer("commit"):
            return self.commit(seqs, starts, tree, accepted, taps, slots)

    def draft(self, seqs, roots, starts, method) -> torch.Tensor | None:
        """Per-depth log-probabilities [N, S-1, V] from the drafter (fp32, temperature 1)."""
        if method == "ar":
            return None
        if not isinstance(self.drafter, DFlashDrafter):
            return self.drafter.draft_logprobs(seqs).to(self.device)
        S, N = self.drafter.block_size, len(seqs)
        embeds = self.drafter.block_embeddings(roots, self.target.model.embed_tokens)
        positions = (self._tensor(starts)[:, None] + torch.arange(S, device=self.device)).reshape(-1)
        ctx = AttentionContext.build(self._block_tables(seqs), starts, [S] * N, self.blocks.block_size,
                                     store=False)
        hidden = self.drafter(embeds, positions, self.drafter_kv, ctx).view(N, S, -1)[:, 1:]
        return torch.log_softmax(self.target.logits(hidden.to(self.dtype)), -1)

    def build(self, roots, logprobs, method, budget) -> Tree:
        N = roots.shape[0]
        if method == "ar":
            empty = torch.zeros(N, 0, dtype=torch.long, device=self.device)
            tokens, parents, depths, max_depth = empty, empty, empty, 0
        elif method == "dflash":
            tokens, parents, depths = chain_tree(logprobs)
            max_depth = logprobs.shape[1]
        else:
            tokens, parents, depths = build_tree_batched(logprobs, budget)
            max_depth = logprobs.shape[1]
        tokens, parents, depths = with_root(roots, tokens, parents, depths)
        return Tree(tokens, parents, depths, min(max_depth, tokens.shape[1] - 1))

    def verify(self, seqs, starts, tree: Tree):
        """One target pass over root + all nodes with the ancestor mask and depth positions."""
        N, T = tree.tokens.shape
        positions = node_positions(self._tensor(starts), tree.depths).reshape(-1)
        tables = self._block_tables(seqs)
        slots = slots_for(tables, self._tensor(starts)[:, None] + torch.arange(T, device=self.device),
                          self.blocks.block_size)
        ctx = AttentionContext.build(tables, starts, [T] * N, self.blocks.block_size,
                                     tree_mask=ancestor_mask(tree.parents, tree.max_depth))
        hidden, taps = self.target(tree.tokens.reshape(-1), positions, self.target_kv, ctx, self.taps)
        logits = self.target.logits(hidden).view(N, T, -1)
        return logits, (taps.view(N, T, -1) if taps is not None else None), slots

    def accept(self, seqs, tree: Tree, logits) -> Accepted:
        p = [s.params for s in seqs]
        for s in seqs:
            if s.params.seed is not None and s.generator is None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.params.seed)
        # Parameters stay on the host so sampling can skip filters nobody asked for without a sync.
        samples = sample_from_logits(
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32),
            torch.tensor([x.top_k for x in p]),
            torch.tensor([x.top_p for x in p], dtype=torch.float32),
            [s.generator for s in seqs])
        path, num_accepted, bonus = accept_walk(tree.tokens, tree.parents, tree.depths, samples, tree.max_depth)
        return Accepted(path, num_accepted, bonus)

    def commit(self, seqs, starts, tree: Tree, acc: Accepted, taps, slots) -> list[list[int]]:
        """Move accepted K/V into chain order, extend the drafter context, return new tokens."""
        L = acc.path.shape[1]
        src_off, dst_off, move = compaction_moves(acc.path, acc.num_accepted)
        keep = dst_off < acc.num_accepted[:, None]  # [N, L] accepted nodes, root first
        src = gather_rows(slots, src_off)           # slots the accepted nodes were written to
        dst = gather_rows(slots, dst_off)           # where chain order puts them
        if bool(move.any()):
            s, d = src[move], dst[move]
            for k_cache, v_cache in self.target_kv:
                k_cache.index_copy_(0, d, k_cache.index_select(0, s))
                v_cache.index_copy_(0, d, v_cache.index_select(0, s))
        if self.drafter_kv:
            positions = (self._tensor(starts)[:, None] + torch.arange(L, device=self.device))[keep]
            self.drafter.store_context(gather_rows(taps, acc.path)[keep], positions, self.drafter_kv, dst[keep])
        tokens = gather_rows(tree.tokens, acc.path)
        out = []
        for i, (seq, n) in enumerate(zip(seqs, acc.num_accepted.tolist())):
            seq.num_cached += n
            out.append(tokens[i, 1:n].tolist() + [int(acc.bonus[i])])
        return out
