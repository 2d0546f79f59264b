"""Runs the models for one engine step. A decode round reads like the DDTree reference:
draft -> build -> verify -> accept -> commit, one named method each. ``ar`` is the same round
with an empty tree and ``dflash`` with a chain of the drafter's argmax tokens.

The round is tensor-in, tensor-out with static shapes and no host reads, so on CUDA each stage
is captured once per (method, budget, batch bucket, sampling mode) as a CUDA graph and a step is
five graph replays plus one read of the committed tokens. Batches are padded to the bucket with
rows that write only to scratch blocks.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.context import AttentionContext
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.sequence import Sequence
from ddtree.kernels import triton_enabled
from ddtree.models.decoder import DecoderLM
from ddtree.models.dflash import DFlashDrafter
from ddtree.tree import (accept_walk, ancestor_mask, build_tree_batched, chain_tree, compaction_moves,
                         gather_rows, sample_from_logits, with_root)
from ddtree.tree import positions as node_positions

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "build", "verify", "accept", "commit")
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


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
class StepInputs:
    """Everything a decode round reads, as tensors on the device (static buffers under graphs)."""
    roots: torch.Tensor        # [N] last committed token = tree root
    starts: torch.Tensor       # [N] its position (= tokens in the cache)
    tables: torch.Tensor       # [N, W] block tables
    temperature: torch.Tensor  # [N]
    top_k: torch.Tensor        # [N]
    top_p: torch.Tensor        # [N]


@dataclass(frozen=True)
class StepKind:
    method: str
    budget: int
    sampling: str         # "greedy" | "sample" | "filtered"
    store_context: bool   # keep the drafter's context up to date (auto may switch methods)


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


class StepGraph:
    """A decode round captured for a batch bucket. Inputs live in two static buffers (ints:
    root, start, top_k, block table; floats: temperature, top_p) filled from pinned host copies
    in one transfer each. ``split`` captures one graph per stage with CUDA events between them
    (for the step-time split); otherwise the round is a single graph."""

    def __init__(self, runner: "ModelRunner", kind: StepKind, n: int, pool, split: bool):
        self.n, self.width = n, runner.table_width
        self.scratch = np.array(runner.scratch[:self.width], dtype=np.int64)
        self.h_ints = torch.zeros(n, 3 + self.width, dtype=torch.long).pin_memory()
        self.h_floats = torch.zeros(n, 2, dtype=torch.float32).pin_memory()
        self.ints = torch.zeros_like(self.h_ints, device=runner.device)
        self.floats = torch.zeros_like(self.h_floats, device=runner.device)
        self._fill_padding(0)
        self._upload()
        self.inputs = StepInputs(self.ints[:, 0], self.ints[:, 1], self.ints[:, 3:], self.floats[:, 0],
                                 self.ints[:, 2], self.floats[:, 1])
        state = {}
        stages = runner.round_stages(kind, self.inputs, runner.max_context, state)
        for fn in stages:  # warm up (Triton compiles, lazy weight fusion) outside capture
            fn()
        torch.cuda.synchronize()
        groups = [[fn] for fn in stages] if split else [stages]
        self.graphs = []
        for group in groups:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                for fn in group:
                    fn()
            self.graphs.append(g)
        self.outputs = state["out"]
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(len(self.graphs) + 1)] if split else []

    def _fill_padding(self, start: int, position: int = 0) -> None:
        """Rows from ``start`` on: root 0 at ``position`` in the scratch blocks, greedy."""
        self.h_ints[start:] = 0
        self.h_ints[start:, 1] = position
        self.h_ints.numpy()[start:, 3:] = self.scratch
        self.h_floats[start:, 0] = 0.0
        self.h_floats[start:, 1] = 1.0

    def _upload(self) -> None:
        self.ints.copy_(self.h_ints, non_blocking=True)
        self.floats.copy_(self.h_floats, non_blocking=True)

    def replay(self, seqs: list[Sequence], pad_position: int = 0):
        ints, floats = self.h_ints.numpy(), self.h_floats.numpy()
        for i, s in enumerate(seqs):
            row = ints[i]
            row[0], row[1], row[2] = s.token_ids[-1], len(s) - 1, s.params.top_k
            k = len(s.block_table)
            row[3:3 + k] = s.block_table
            row[3 + k:] = self.scratch[:self.width - k]
            floats[i] = (s.params.temperature, s.params.top_p)
        self._fill_padding(len(seqs), pad_position)  # rows of an earlier, larger batch
        self._upload()
        for i, g in enumerate(self.graphs):
            if self.events:
                self.events[i].record()
            g.replay()
        if self.events:
            self.events[-1].record()
        return self.outputs

    def stage_seconds(self) -> list[float]:
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events[:-1], self.events[1:])]


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter, blocks: BlockManager, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, max_lookahead: int, cuda_graphs: bool = True):
        self.target, self.drafter = target, drafter
        self.blocks, self.device, self.dtype = blocks, device, dtype
        self.timer = StageTimer(device)
        bs = blocks.block_size
        self.table_width = -(-(max_model_len + max_lookahead) // bs)
        self.max_context = self.table_width * bs
        # Scratch blocks after the pool: padded batch rows write there and nowhere else.
        self.scratch = list(range(blocks.num_blocks, blocks.num_blocks + self.table_width))
        num_slots = (blocks.num_blocks + self.table_width) * bs
        self.target_kv = self._alloc_kv(target.kv_shape(), num_slots)
        self.drafter_kv = None
        if isinstance(drafter, DFlashDrafter):
            self.drafter_kv = self._alloc_kv(drafter.kv_shape(), num_slots)
        self.taps = tuple(getattr(drafter, "taps", ()))
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.graphs: dict[tuple[StepKind, int, bool], StepGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.profile_stages = False       # record a per-stage split of graph replays
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.last_step: tuple[str, int] | None = None  # (method, budget) of the last decode round
        self.decode_calls = 0

    def _alloc_kv(self, shape, num_slots) -> torch.Tensor:
        """One tensor [layers, 2, slots, heads, dim] so a compaction moves every layer at once."""
        layers, heads, dim = shape
        return torch.zeros(layers, 2, num_slots, heads, dim, device=self.device, dtype=self.dtype)

    @staticmethod
    def lookahead_for(method: str, budget: int, drafter) -> int:
        """Cache slots a decode step writes from the root on (root + tree nodes; the drafter's
        block is written there too)."""
        if method == "ar":
            return 1
        if method == "dflash":
            return drafter.block_size
        return max(budget + 1, getattr(drafter, "block_size", 0))

    def lookahead(self, method: str, budget: int) -> int:
        return self.lookahead_for(method, budget, self.drafter)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + self.scratch[:width - len(s.block_table)] for s in seqs])

    # ---- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunks: list[int]) -> None:
        """Run the target over uncached prompt tokens (never the last one: it is the first root)."""
        ids, pos = [], []
        for seq, n in zip(seqs, chunks):
            a, b = seq.num_cached, seq.num_cached + n
            ids += seq.token_ids[a:b]
            pos += range(a, b)
        ctx = AttentionContext.build(self._tables(seqs), [s.num_cached for s in seqs], chunks,
                                     self.blocks.block_size)
        positions = self._tensor(pos)
        with self.timer("prefill"):
            _, taps = self.target(self._tensor(ids), positions, self.target_kv, ctx, self.taps)
            if self.drafter_kv is not None:
                self.drafter.store_context(taps, positions, self.drafter_kv, ctx.slot_mapping)
        for seq, n in zip(seqs, chunks):
            seq.num_cached += n

    # ---- one decode round --------------------------------------------------------------------
    def step_kind(self, seqs: list[Sequence], method: str, budget: int, store_context: bool) -> StepKind:
        temps = [s.params.temperature for s in seqs]
        if all(t <= 0 for t in temps):
            sampling = "greedy"
        elif all(s.params.top_k == 0 and s.params.top_p >= 1 for s in seqs):
            sampling = "sample"
        else:
            sampling = "filtered"
        if method == "ar":
            budget = 0
        return StepKind(method, budget, sampling, store_context and self.drafter_kv is not None)

    def _inputs(self, seqs: list[Sequence]) -> StepInputs:
        p = [s.params for s in seqs]
        return StepInputs(
            roots=self._tensor([s.token_ids[-1] for s in seqs]),
            starts=self._tensor([len(s) - 1 for s in seqs]),
            tables=self._tables(seqs),
            temperature=self._tensor([x.temperature for x in p], torch.float32),
            top_k=self._tensor([x.top_k for x in p]),
            top_p=self._tensor([x.top_p for x in p], torch.float32))

    def graph_bucket(self, n: int, kind: StepKind, seqs: list[Sequence]) -> int | None:
        if not self.use_graphs or any(s.params.seed is not None for s in seqs):
            return None  # seeded requests draw from their own generators, eagerly
        if not isinstance(self.drafter, DFlashDrafter) and kind.method != "ar":
            return None
        return next((b for b in GRAPH_BUCKETS if b >= n), None)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], method: str, budget: int, store_context: bool = False) -> list[list[int]]:
        """One verify round for every sequence; returns the tokens each one commits."""
        kind = self.step_kind(seqs, method, budget, store_context)
        self.last_step = (kind.method, kind.budget)
        self.decode_calls += 1
        n = len(seqs)
        bucket = self.graph_bucket(n, kind, seqs)
        if bucket is not None:
            graph = self._graph(kind, bucket)
            tokens, num_accepted, bonus = graph.replay(seqs)
        else:
            state = {}
            inputs = self._inputs(seqs)
            max_keys = max(len(s) for s in seqs) + self.lookahead(kind.method, kind.budget)
            gens = None
            if any(s.params.seed is not None for s in seqs):
                for s in seqs:
                    if s.params.seed is not None and s.generator is None:
                        s.generator = torch.Generator(device=self.device).manual_seed(s.params.seed)
                gens = [s.generator for s in seqs]
            for name, fn in zip(STAGES, self.round_stages(kind, inputs, max_keys, state, seqs, gens)):
                with self.timer(name):
                    fn()
            tokens, num_accepted, bonus = state["out"]
        packed = torch.cat([num_accepted[:n, None], bonus[:n, None], tokens[:n]], 1).tolist()  # the one sync
        if bucket is not None and self.profile_stages:
            for name, sec in zip(STAGES, graph.stage_seconds()):
                self.stage_seconds[name] += sec
        out = []
        for seq, row in zip(seqs, packed):
            k = row[0]
            seq.num_cached += k
            out.append(row[3:2 + k] + [row[1]])
        return out

    def _graph(self, kind: StepKind, bucket: int) -> StepGraph:
        key = (kind, bucket, self.profile_stages)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = StepGraph(self, kind, bucket, self.graph_pool, self.profile_stages)
        return graph

    @torch.inference_mode()
    def time_graph(self, method: str, budget: int, bucket: int, greedy: bool = True, reps: int = 10,
                   context: int = 512) -> float:
        """Seconds per replay of a step graph on padding rows at position ``context`` (so attention
        reads a realistic prefix); captures the graph if needed."""
        context = max(0, min(context, self.max_context - self.lookahead(method, budget) - 1))
        kind = StepKind(method, budget if method == "ddtree" else 0, "greedy" if greedy else "sample",
                        self.drafter_kv is not None)
        graph = self._graph(kind, bucket)
        graph.replay([], context)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay([], context)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    def round_stages(self, kind: StepKind, inp: StepInputs, max_keys: int, state: dict,
                     seqs: list[Sequence] | None = None, generators=None):
        """The round as five closures over ``state`` (each one a graph under capture)."""
        def draft():
            state["logprobs"] = self.draft(kind, inp, max_keys, seqs)

        def build():
            state["tree"] = self.build(kind, inp.roots, state["logprobs"])

        def verify():
            state["verified"] = self.verify(kind, inp, state["tree"], max_keys)

        def accept():
            logits, ancestors = state["verified"][0], state["verified"][3]
            state["accepted"] = self.accept(kind, inp, state["tree"], logits, ancestors, generators)

        def commit():
            state["out"] = self.commit(kind, inp, state["tree"], state["accepted"], *state["verified"][1:3])

        return draft, build, verify, accept, commit

    @torch.inference_mode()
    def draft_for(self, seqs: list[Sequence]) -> torch.Tensor:
        """The drafter's per-depth log-probabilities for these sequences' next block (eager; for
        tests and tools)."""
        kind = self.step_kind(seqs, "ddtree", 1, store_context=False)
        return self.draft(kind, self._inputs(seqs), max(len(s) for s in seqs) + self.drafter.block_size, seqs)

    def draft(self, kind: StepKind, inp: StepInputs, max_keys: int, seqs) -> torch.Tensor | None:
        """Per-depth log-probabilities [N, S-1, V] from the drafter (fp32, temperature 1)."""
        if kind.method == "ar":
            return None
        if not isinstance(self.drafter, DFlashDrafter):
            return self.drafter.draft_logprobs(seqs).to(self.device)
        S, N = self.drafter.block_size, inp.roots.shape[0]
        embeds = self.drafter.block_embeddings(inp.roots, self.target.model.embed_tokens)
        positions = (inp.starts[:, None] + torch.arange(S, device=self.device)).reshape(-1)
        ctx = AttentionContext.uniform(inp.tables, inp.starts, S, self.blocks.block_size, max_keys, mask="full")
        hidden = self.drafter(embeds, positions, self.drafter_kv, ctx).view(N, S, -1)[:, 1:]
        return torch.log_softmax(self.target.logits(hidden.to(self.dtype)), -1)

    def build(self, kind: StepKind, roots: torch.Tensor, logprobs) -> Tree:
        N = roots.shape[0]
        if kind.method == "ar":
            empty = torch.zeros(N, 0, dtype=torch.long, device=self.device)
            tokens, parents, depths, max_depth = empty, empty, empty, 0
        elif kind.method == "dflash":
            tokens, parents, depths = chain_tree(logprobs)
            max_depth = logprobs.shape[1]
        else:
            if triton_enabled(logprobs):
                from ddtree.kernels.triton_tree import build_tree_triton
                tokens, parents, depths = build_tree_triton(logprobs, kind.budget)
            else:
                tokens, parents, depths = build_tree_batched(logprobs, kind.budget)
            max_depth = logprobs.shape[1]
        tokens, parents, depths = with_root(roots, tokens, parents, depths)
        return Tree(tokens, parents, depths, min(max_depth, tokens.shape[1] - 1))

    def verify(self, kind: StepKind, inp: StepInputs, tree: Tree, max_keys: int):
        """One target pass over root + all nodes with the ancestor mask and depth positions."""
        N, T = tree.tokens.shape
        positions = node_positions(inp.starts, tree.depths).reshape(-1)
        if kind.method == "ddtree":
            ancestors = ancestor_mask(tree.parents, tree.max_depth)
            ctx = AttentionContext.uniform(inp.tables, inp.starts, T, self.blocks.block_size, max_keys,
                                           mask="tree", tree_mask=ancestors)
        else:  # a chain's ancestor mask is causal
            ancestors = torch.ones(T, T, dtype=torch.bool, device=self.device).tril().expand(N, T, T)
            ctx = AttentionContext.uniform(inp.tables, inp.starts, T, self.blocks.block_size, max_keys)
        taps = self.taps if (kind.method != "ar" or kind.store_context) else ()
        hidden, tapped = self.target(tree.tokens.reshape(-1), positions, self.target_kv, ctx, taps)
        logits = self.target.logits(hidden).view(N, T, -1)
        return logits, (tapped.view(N, T, -1) if tapped is not None else None), ctx.slot_mapping.view(N, T), ancestors

    def accept(self, kind: StepKind, inp: StepInputs, tree: Tree, logits, ancestors, generators):
        samples = sample_from_logits(logits, inp.temperature, inp.top_k, inp.top_p, generators,
                                     all_greedy=kind.sampling == "greedy",
                                     use_filters=kind.sampling == "filtered")
        return accept_walk(tree.tokens, tree.parents, tree.depths, samples, tree.max_depth, ancestors)

    def commit(self, kind: StepKind, inp: StepInputs, tree: Tree, accepted, taps, slots):
        """Move accepted K/V into chain order, extend the drafter context; returns
        (tokens [N, L] root first, num_accepted [N], bonus [N]) without reading them."""
        path, num_accepted, bonus = accepted
        L = path.shape[1]
        src_off, dst_off, move = compaction_moves(path, num_accepted)
        dst = gather_rows(slots, dst_off)
        if kind.method == "ddtree":  # a chain's accepted nodes are already in chain order
            src = torch.where(move, gather_rows(slots, src_off), dst).reshape(-1)
            self.target_kv[:, :, dst.reshape(-1)] = self.target_kv[:, :, src]
        if taps is not None and self.drafter_kv is not None:
            # Rows past the accepted length write harmless context beyond the committed prefix.
            positions = (inp.starts[:, None] + torch.arange(L, device=self.device)).reshape(-1)
            self.drafter.store_context(gather_rows(taps, path).reshape(-1, taps.shape[-1]), positions,
                                       self.drafter_kv, dst.reshape(-1))
        return gather_rows(tree.tokens, path), num_accepted, bonus
