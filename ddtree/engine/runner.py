"""Runs the models for one engine step. A decode round reads like the DDTree reference:
draft -> build -> verify -> accept -> commit (KV compaction) -> context (the drafter's), one
named method each. ``ar`` is the same round with an empty tree and ``dflash`` with a chain of the
drafter's argmax tokens.

The round is tensor-in, tensor-out with static shapes and no host reads, so on CUDA the whole
round is captured once per (method, budget, batch bucket, sampling mode) as a CUDA graph and a
step is one graph replay plus one read of the committed tokens; the next round can be launched
from this one's device outputs before that read (``Launched``). Batches are padded to the bucket
with rows that write only to scratch blocks. Prefill steps are captured too, by bucket of tokens
and of sequences.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ddtree.context import AttentionContext
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.sequence import CONTEXT_PENDING, Sequence
from ddtree.kernels import triton_enabled
from ddtree.models.decoder import DecoderLM
from ddtree.models.dflash import DFlashDrafter
from ddtree.tree import (Processing, accept_walk, ancestor_mask, build_tree_batched, chain_tree,
                         compaction_moves, gather_rows, process_tree_logits, sample_from_logits, with_root)

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "build", "verify", "accept", "commit", "context")
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # tokens of a captured prefill step
PREFILL_SEQ_BUCKETS = (1, 4, 16, 64)  # sequences of a captured prefill step
CATCH_UP_BUCKETS = (64, 256, 1024, 4096)  # deferred tokens of a captured catch-up (more: several)
# Key bounds, besides the context limit, that decode rounds of up to KEY_BOUND_BATCH sequences are
# also captured for; a round replays the smallest that holds its keys. A captured round sizes its
# attention's key splits by its bound (kv_splits_for): under the bench's 2,112 keys, batch 1 runs
# 16-32 splits, most of them empty at a few hundred keys (each split's range is cut from the real
# length), and so do AR and the chain at batch 4. On an H100 (bench/results/ab_key_bounds_*h100*.json)
# the bounds made c=1 1.1-2.3 % faster for AR, the chain and B=63, and, extended to batch 4, c=4
# AR +1.6 % and the chain +1.0 % (a batch-4 tree runs 4 splits under any bound: unchanged).
# Larger batches run few splits anyway.
GRAPH_KEY_BOUNDS = (512, 1024)
KEY_BOUND_BATCH = 4


@dataclass
class Tree:
    tokens: torch.Tensor   # [N, T] root at 0
    parents: torch.Tensor  # [N, T]
    depths: torch.Tensor   # [N, T]
    max_depth: int
    ancestors: torch.Tensor | None  # [N, T, T] bool: node j is node i or an ancestor (None: ar)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


class Verified(NamedTuple):
    """The verify pass's outputs: logits [N, T, V] fp32, or (fused sampling) the target's token
    at every node [N, T]; the tapped features [N, T, F] (None: no taps); the nodes' slots [N, T]."""
    logits: torch.Tensor | None
    samples: torch.Tensor | None
    taps: torch.Tensor | None
    slots: torch.Tensor


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
    # (plain decoding with a tap cache stores only the root's taps; see ModelRunner.catch_up)


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


@dataclass
class Launched:
    """A decode round that is on its way: ``packed`` rows are (num_accepted, bonus, stop_ahead,
    path tokens...) once ``event`` has completed (None: already complete). ``num_accepted`` and
    ``bonus`` stay on the device so the next round can be launched from them before the host
    reads anything."""
    seqs: list[Sequence]
    kind: StepKind
    packed: torch.Tensor
    event: torch.cuda.Event | None
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    graph: "StepGraph | None" = None
    after: bool = False      # launched behind another round, before that one was read
    # set by the engine: launch time, chosen by "auto", timed (no graph capture inside)
    started: float = 0.0
    by_auto: bool = False
    timed: bool = True
    path_nodes: list[list[int]] | None = None  # set by finish(): accepted tree nodes below the root
    # Eager rounds of requests that want logprobs: (token logprobs [N, L], top ids [N, L, K], top
    # logprobs [N, L, K]) on the device; finish() reads them into token_logprobs (per sequence).
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    token_logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    # A fresh round launched while a prefill still ran: (prefill end, round end) CUDA events, so
    # its cost can be told apart from the prefill's remaining GPU time.
    behind_prefill: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def seconds_behind_prefill(self) -> float | None:
        """GPU time from the prefill's end to this round's end (None: not launched behind one)."""
        if self.behind_prefill is None:
            return None
        start, end = self.behind_prefill
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class StepGraph:
    """A decode round captured for a batch bucket. Inputs live in two static buffers (ints:
    root, start, top_k, block table; floats: temperature, top_p) filled from pinned host copies
    in one transfer each; outputs come back packed in one transfer. Host buffers come in two
    slots used alternately, so a round can be filled while the previous one still runs.
    ``split`` captures one graph per stage with CUDA events between them (for the step-time
    split); otherwise the round is a single graph."""

    def __init__(self, runner: "ModelRunner", kind: StepKind, n: int, pool, split: bool, max_keys: int):
        self.n, self.width = n, runner.table_width
        self.scratch = np.array(runner.scratch[:self.width], dtype=np.int64)
        self.h_ints = [torch.zeros(n, 3 + self.width, dtype=torch.long).pin_memory() for _ in range(2)]
        self.h_floats = [torch.zeros(n, 2, dtype=torch.float32).pin_memory() for _ in range(2)]
        self.ints = torch.zeros_like(self.h_ints[0], device=runner.device)
        self.floats = torch.zeros_like(self.h_floats[0], device=runner.device)
        self._fill_padding(0, 0, 0)
        self._upload(0)
        self.inputs = StepInputs(self.ints[:, 0], self.ints[:, 1], self.ints[:, 3:], self.floats[:, 0],
                                 self.ints[:, 2], self.floats[:, 1])
        state = {}
        stages = list(runner.round_stages(kind, self.inputs, max_keys, state))
        stages[-1] = _then(stages[-1], lambda: state.update(packed=runner.pack(state)))
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
        _, self.num_accepted, self.bonus = state["out"]
        self.packed = state["packed"]
        self.h_out = [torch.zeros(self.packed.shape, dtype=torch.long).pin_memory() for _ in range(2)]
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(len(self.graphs) + 1)] if split else []

    def _fill_padding(self, slot: int, start: int, position: int = 0) -> None:
        """Rows from ``start`` on: root 0 at ``position`` in the scratch blocks, greedy."""
        ints, floats = self.h_ints[slot], self.h_floats[slot]
        ints[start:] = 0
        ints[start:, 1] = position
        ints.numpy()[start:, 3:] = self.scratch
        floats[start:, 0] = 0.0
        floats[start:, 1] = 1.0

    def _upload(self, slot: int) -> None:
        self.ints.copy_(self.h_ints[slot], non_blocking=True)
        self.floats.copy_(self.h_floats[slot], non_blocking=True)

    def replay(self, seqs: list[Sequence], pad_position: int = 0, slot: int = 0,
               after: Launched | None = None) -> torch.cuda.Event:
        """Launch the round for ``seqs`` (no host sync); ``after``: the round just launched for the
        same sequences, whose roots and accepted counts are taken on the device. Returns the
        event after which ``h_out[slot]`` holds the packed outputs."""
        ints, floats = self.h_ints[slot].numpy(), self.h_floats[slot].numpy()
        for i, s in enumerate(seqs):
            row = ints[i]
            row[0], row[1], row[2] = s.token_ids[-1], len(s) - 1, s.params.top_k
            k = len(s.block_table)
            row[3:3 + k] = s.block_table
            row[3 + k:] = self.scratch[:self.width - k]
            floats[i] = (s.params.temperature, s.params.top_p)
        self._fill_padding(slot, len(seqs), pad_position)  # rows of an earlier, larger batch
        self._upload(slot)
        if after is not None:
            n = len(seqs)
            self.ints[:n, 0].copy_(after.bonus[:n])
            self.ints[:n, 1].add_(after.num_accepted[:n])
        for i, g in enumerate(self.graphs):
            if self.events:
                self.events[i].record()
            g.replay()
        if self.events:
            self.events[-1].record()
        self.h_out[slot].copy_(self.packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def replay_seconds(self, context: int, reps: int) -> float:
        """Seconds per replay on padding rows at position ``context`` (after one warm replay)."""
        self.replay([], context).synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):  # slots alternate: a slot's previous upload and readback are done
            self.replay([], context, slot=i % 2)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    def stage_seconds(self) -> list[float]:
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events[:-1], self.events[1:])]


class PrefillGraph:
    """A prefill step of up to ``tokens`` new tokens from up to ``seqs`` sequences, captured: an
    eager prefill is hundreds of kernel launches (12-20 ms on the H200 against 1-2 ms replayed),
    paid whenever new requests join. Inputs (token ids, positions, cache slots, block tables,
    cached lengths, query offsets) live in one static buffer filled from a pinned host copy.
    Rows past the last chunk are padding: no sequence's queries cover them and their K/V go to a
    scratch slot; padding sequences have no new tokens."""

    def __init__(self, runner: "ModelRunner", tokens: int, seqs: int, pool):
        T, S, W = tokens, seqs, runner.table_width
        self.tokens, self.seqs, self.width, self.block_size = T, S, W, runner.blocks.block_size
        self.scratch_slot = runner.scratch[0] * self.block_size
        self.h_ints = torch.zeros(3 * T + S * W + 2 * S + 1, dtype=torch.long).pin_memory()
        self.ints = torch.zeros_like(self.h_ints, device=runner.device)
        ids, positions, slots = self.ints[:T], self.ints[T:2 * T], self.ints[2 * T:3 * T]
        tables = self.ints[3 * T:3 * T + S * W].view(S, W)
        cached, query_start = self.ints[3 * T + S * W:3 * T + S * W + S], self.ints[3 * T + S * W + S:]
        ctx = AttentionContext(tables, cached, query_start, slots, self.block_size, T, runner.max_context)

        def forward():
            _, taps = runner.target(ids, positions, runner.target_kv, ctx, runner.taps)
            runner.store_prompt_context(taps, positions, slots)

        self.uploaded = torch.cuda.Event()
        self.fill([(runner.scratch[:1], 0, [0])])
        self.ints.copy_(self.h_ints)
        forward()  # warm up outside capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            forward()

    def fill(self, chunks: list[tuple[list[int], int, list[int]]]) -> None:
        """chunks: (block table, first position, token ids) per sequence."""
        T, S, W, bs = self.tokens, self.seqs, self.width, self.block_size
        h = self.h_ints.numpy()
        h[:] = 0
        ids, positions, slots = h[:T], h[T:2 * T], h[2 * T:3 * T]
        tables = h[3 * T:3 * T + S * W].reshape(S, W)
        cached, query_start = h[3 * T + S * W:3 * T + S * W + S], h[3 * T + S * W + S:]
        off = 0
        for i, (table, start, token_ids) in enumerate(chunks):
            n = len(token_ids)
            ids[off:off + n] = token_ids
            slots[off:off + n], positions[off:off + n] = position_slots([start], [start + n], [table], bs)
            tables[i, :len(table)] = table
            cached[i] = start
            off += n
            query_start[i + 1] = off
        slots[off:] = self.scratch_slot
        query_start[len(chunks) + 1:] = off

    def run(self, seqs: list[Sequence], chunks: list[int]) -> None:
        """Launch without a sync: the host prepares the next round while the GPU prefills (a
        stream sync here cost ~0.25 ms of unhidden host work per new request at concurrency 64)."""
        self.uploaded.synchronize()  # the previous run's upload has left the pinned buffer
        self.fill([(s.block_table, s.num_cached, s.token_ids[s.num_cached:s.num_cached + n])
                   for s, n in zip(seqs, chunks)])
        self.ints.copy_(self.h_ints, non_blocking=True)
        self.uploaded.record()
        self.graph.replay()


class CatchUpGraph:
    """ModelRunner.store_deferred for up to ``tokens`` deferred positions, captured. Padding
    rows project the scratch slot's taps into the scratch slot."""

    def __init__(self, runner: "ModelRunner", tokens: int, pool):
        self.tokens = tokens
        self.pad_slot = runner.scratch[0] * runner.blocks.block_size
        self.host = torch.zeros(2, tokens, dtype=torch.long).pin_memory()
        self.ints = torch.zeros_like(self.host, device=runner.device)
        self.uploaded = torch.cuda.Event()
        self.host[0] = self.pad_slot
        self.ints.copy_(self.host)
        runner.store_deferred(self.ints[0], self.ints[1])  # warm up outside capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            runner.store_deferred(self.ints[0], self.ints[1])
        self.uploaded.record()

    def run(self, slots: np.ndarray, positions: np.ndarray) -> None:
        n = len(slots)
        self.uploaded.synchronize()  # the previous run's upload has left the pinned buffer
        h = self.host.numpy()
        h[0, :n], h[1, :n] = slots, positions
        h[0, n:], h[1, n:] = self.pad_slot, 0
        self.ints.copy_(self.host, non_blocking=True)
        self.uploaded.record()
        self.graph.replay()


def _then(first, second):
    def both():
        first()
        second()
    return both


def position_slots(lo, hi, tables, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cache slots and positions of positions lo[i] <= p < hi[i] of sequence i (block table
    tables[i]), all sequences in one vectorised pass."""
    counts = np.subtract(hi, lo)
    pos = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts - np.asarray(lo), counts)
    table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    row = np.repeat(np.arange(len(tables)), counts)
    return table[row, pos // block_size] * block_size + pos % block_size, pos


def pack_outputs(tokens: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor,
                 path: torch.Tensor, stop_ahead: torch.Tensor) -> torch.Tensor:
    """[N, 3 + 2L]: num_accepted, bonus, stop_ahead, path tokens and path nodes (root first): one
    transfer to the host."""
    return torch.cat([num_accepted[:, None], bonus[:, None], stop_ahead[:, None], tokens, path], 1)


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter, blocks: BlockManager, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, max_lookahead: int, cuda_graphs: bool = True,
                 defer_context: bool = False):
        self.target, self.drafter = target, drafter
        # Inference only: no autograd graphs, and the Triton kernels (which have no backward) stay on.
        for model in (target, drafter):
            if isinstance(model, torch.nn.Module):  # test drafters may be plain objects
                model.requires_grad_(False)
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
        # Rotary rows by position, read in the launch that makes a step's slots. Past any position
        # a step reaches: the context bound, a round's lookahead and the drafter's block.
        rows = self.max_context + max_lookahead + getattr(drafter, "block_size", 0) + 1
        self.target_rope = target.rotary.table(rows)
        self.drafter_rope = drafter.rotary.table(rows) if isinstance(drafter, DFlashDrafter) else None
        self.taps = tuple(getattr(drafter, "taps", ()))
        self.eos_token_ids: set[int] = set()  # blocked by min_tokens (set by the engine)
        self._stop_ids: tuple[tuple[int, ...], torch.Tensor] | None = None
        # Seed of the Triton sampler (CUDA), advanced on the device by every sampled round (graphs
        # too); drawn from torch's generator so LLM(seed=...) fixes it.
        self.sample_seed = (torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
                            if device.type == "cuda" else None)
        # Plain-decoding rounds under budget="auto" keep only their tapped target features here
        # (by cache slot); the drafter projects them when a speculative round next needs them.
        # Storing the drafter's K/V every plain round cost 5-6 % of the round on the H200.
        self.tap_cache = None
        if defer_context and self.drafter_kv is not None:
            self.tap_cache = torch.zeros(num_slots, len(self.taps) * target.config.hidden_size,
                                         device=device, dtype=dtype)
        self.caught_up_tokens = 0
        self.catch_up_graphs: dict[int, CatchUpGraph] = {}
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.graphs: dict[tuple[StepKind, int, int, bool], StepGraph] = {}  # kind, bucket, key bound
        self.prefill_graphs: dict[tuple[int, int], PrefillGraph] = {}  # (tokens, sequences)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Catch-ups replay between a round and the next one, which reads the first's outputs: in
        # the rounds' pool, a catch-up captured before them could reuse (and overwrite) the
        # memory those outputs later got (seen on the H200: garbage roots).
        self.catch_up_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Graph prefills run without a host sync: their GPU spans, settled once done, and the
        # latest one's end (a fresh round launched before it is timed from there).
        self.prefill_spans: deque = deque()
        self.prefill_done: torch.cuda.Event | None = None
        self.profile_stages = False       # record a per-stage split of graph replays
        self.stage_seconds: dict[str, float] = defaultdict(float)
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
        tokens = next((b for b in PREFILL_BUCKETS if b >= sum(chunks)), None)
        width = next((b for b in PREFILL_SEQ_BUCKETS if b >= len(seqs)), None)
        wants_logits = any(s.prompt_logprobs is not None for s in seqs)
        if self.use_graphs and tokens is not None and width is not None and not wants_logits:
            graph = self.prefill_graph(tokens, width)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.run(seqs, chunks)
            end.record()
            self.prefill_spans.append((start, end))
            self.prefill_done = end
            self.settle_prefill_spans(wait=False)
            self._prefilled(seqs, chunks)
            return
        ids, pos = [], []
        for seq, n in zip(seqs, chunks):
            a, b = seq.num_cached, seq.num_cached + n
            ids += seq.token_ids[a:b]
            pos += range(a, b)
        ctx = AttentionContext.build(self._tables(seqs), [s.num_cached for s in seqs], chunks,
                                     self.blocks.block_size)
        positions = self._tensor(pos)
        with self.timer("prefill"):
            hidden, taps = self.target(self._tensor(ids), positions, self.target_kv, ctx, self.taps)
            self.store_prompt_context(taps, positions, ctx.slot_mapping)
        if wants_logits:
            self.record_prompt_logprobs(seqs, chunks, hidden)
        self._prefilled(seqs, chunks)

    def record_prompt_logprobs(self, seqs: list[Sequence], chunks: list[int], hidden: torch.Tensor) -> None:
        """Prompt tokens' raw logprobs from a prefill chunk: the row of position p predicts the
        prompt token at p + 1 (the prefill never runs the last prompt token, the first root)."""
        row = 0
        for seq, n in zip(seqs, chunks):
            a, k = seq.num_cached, seq.params.prompt_logprobs
            if seq.prompt_logprobs is not None:
                logp = torch.log_softmax(self.target.logits(hidden[row:row + n]).float(), -1)
                nxt = torch.tensor(seq.token_ids[a + 1:a + n + 1], device=logp.device)
                chosen = logp.gather(1, nxt[:, None])[:, 0].tolist()
                top_lp, top_ids = logp.topk(k, -1)
                for j, (lp, ids, lps) in enumerate(zip(chosen, top_ids.tolist(), top_lp.tolist())):
                    if a + j < len(seq.prompt_logprobs):  # a recompute also prefills output tokens
                        seq.prompt_logprobs[a + j] = (lp, list(zip(ids, lps)))
            row += n

    def settle_prefill_spans(self, wait: bool = True) -> None:
        """Add the finished graph prefills' GPU time to ``timer.totals["prefill"]`` (all of them
        with ``wait``)."""
        while self.prefill_spans and (wait or self.prefill_spans[0][1].query()):
            start, end = self.prefill_spans.popleft()
            end.synchronize()
            self.timer.totals["prefill"] += start.elapsed_time(end) / 1e3

    def store_prompt_context(self, taps, positions, slots) -> None:
        """Prompt tokens' tapped features: under budget="auto" (a tap cache) only kept, to be
        projected into the drafter's context by the sequence's first speculative round if one
        comes (at concurrency 64 in the H200 grid auto ran 95-99 % of full-batch rounds as plain
        decoding: most prompts never need it); else projected now."""
        if self.tap_cache is not None:
            self.tap_cache[slots] = taps
        elif self.drafter_kv is not None:
            self.drafter.store_context(taps, positions, self.drafter_kv, slots)

    def _prefilled(self, seqs: list[Sequence], chunks: list[int]) -> None:
        for seq, n in zip(seqs, chunks):
            if self.tap_cache is not None and seq.context_from is None:
                seq.context_from = seq.num_cached  # deferred from the chunk's first token on
            seq.num_cached += n

    def prefill_graph(self, tokens: int, seqs: int = 1) -> PrefillGraph:
        graph = self.prefill_graphs.get((tokens, seqs))
        if graph is None:
            graph = self.prefill_graphs[(tokens, seqs)] = PrefillGraph(self, tokens, seqs, self.graph_pool)
        return graph

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

    @staticmethod
    def eager_only(seqs: list[Sequence]) -> bool:
        """Rounds no graph can run: seeded requests draw from their own generators; logprobs and
        logits processing need the verify pass's logits (the captured rounds sample in the LM
        head's epilogue)."""
        return any(s.eager_only for s in seqs)

    def graph_bucket(self, n: int, kind: StepKind, seqs: list[Sequence]) -> int | None:
        if not self.use_graphs or self.eager_only(seqs):
            return None
        if not isinstance(self.drafter, DFlashDrafter) and kind.method != "ar":
            return None
        return next((b for b in GRAPH_BUCKETS if b >= n), None)

    def can_launch_after(self, seqs: list[Sequence]) -> bool:
        """Whether a round for ``seqs`` may be launched before the previous one is read: graph
        replays on CUDA (the host then runs ahead of the GPU) and any round on the CPU, as long
        as the drafter keeps its state on the device (a host-side drafter would draft from
        tokens the host has not read yet)."""
        if self.drafter is not None and not isinstance(self.drafter, DFlashDrafter):
            return False
        if any(s.processes_logits for s in seqs):  # penalties count the committed tokens
            return False
        if self.device.type == "cpu":
            return not self.profile_stages
        return self.use_graphs and not self.profile_stages and not self.eager_only(seqs)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], method: str, budget: int, store_context: bool = False,
               after: Launched | None = None) -> Launched:
        """Start one verify round (no host read on CUDA graphs). ``after``: the round launched just
        before for the same sequences and not read yet; this round starts where it ends (its
        bonus token is the root, its accepted tokens are in the cache), so the host never waits
        between rounds. The blocks must already cover both rounds' lookahead."""
        kind = self.step_kind(seqs, method, budget, store_context)
        if self.tap_cache is not None:
            self.track_context(seqs, kind, after)
        self.decode_calls += 1
        n = len(seqs)
        # Keys per sequence this round may reach (``after``'s tokens are not read yet).
        ahead = self.lookahead(after.kind.method, after.kind.budget) if after is not None else 0
        max_keys = max(len(s) for s in seqs) + ahead + self.lookahead(kind.method, kind.budget)
        bucket = self.graph_bucket(n, kind, seqs)
        if bucket is not None:
            graph = self._graph(kind, bucket, self.key_bound(bucket, max_keys))
            slot = self.decode_calls % 2
            event = graph.replay(seqs, slot=slot, after=after)
            launched = Launched(seqs, kind, graph.h_out[slot], event, graph.num_accepted, graph.bonus, graph,
                                after is not None)
            if after is None and self.prefill_done is not None:
                if self.prefill_done.query():  # done: later rounds need not ask again
                    self.prefill_done = None
                else:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    launched.behind_prefill = (self.prefill_done, end)
            return launched
        state = {}
        inputs = self._inputs(seqs)
        if after is not None:
            inputs.roots = after.bonus[:n].clone()
            inputs.starts = inputs.starts + after.num_accepted[:n]
        gens = None
        if any(s.params.seed is not None for s in seqs):
            for s in seqs:
                if s.params.seed is not None and s.generator is None:
                    s.generator = torch.Generator(device=self.device).manual_seed(s.params.seed)
            gens = [s.generator for s in seqs]
        top = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        processing = self.processing(seqs) if any(s.processes_logits for s in seqs) else None
        for name, fn in zip(STAGES, self.round_stages(kind, inputs, max_keys, state, seqs, gens,
                                                      bool(top) or processing is not None, processing)):
            with self.timer(name):
                fn()
        tokens, num_accepted, bonus = state["out"]
        launched = Launched(seqs, kind, self.pack(state), None, num_accepted, bonus, after=after is not None)
        if top:
            launched.logprobs = self.token_logprobs(state.get("raw_logits", state["verified"].logits),
                                                    state["accepted"], tokens, max(top))
        return launched

    def processing(self, seqs: list[Sequence]) -> Processing:
        """The committed prefix's counts, bias and limits of the round's requests that process
        their logits (``Processing.rows``: their rows in the batch)."""
        rows = [i for i, s in enumerate(seqs) if s.processes_logits]
        seqs = [seqs[i] for i in rows]
        p = [s.params for s in seqs]
        return Processing.build(
            [s.output_token_ids for s in seqs], [s.token_ids[:s.num_prompt_tokens] for s in seqs],
            [x.logit_bias for x in p], [float(x.repetition_penalty) for x in p],
            [float(x.frequency_penalty) for x in p], [float(x.presence_penalty) for x in p],
            [max(0, x.min_tokens - s.num_output_tokens) for s, x in zip(seqs, p)],
            [sorted(self.eos_token_ids | set(x.stop_token_ids)) for x in p],
            self.target.config.vocab_size, self.device, rows,
            [float(x.min_p) for x in p], [float(x.temperature) for x in p],
            [x.allowed_token_ids for x in p], [s.bad_words_token_ids for s in seqs])

    @staticmethod
    def token_logprobs(logits: torch.Tensor, accepted, tokens: torch.Tensor, k: int):
        """Log-probabilities of the tokens a round commits, from the verify pass's raw logits:
        committed token j (j < num_accepted) was predicted at accepted node j (the root for j = 0);
        the last one is the bonus token. Returns (their logprobs [N, L], the k most likely tokens
        [N, L, k] and their logprobs); rows past num_accepted are padding."""
        path, num_accepted, bonus = accepted
        logp = torch.log_softmax(gather_rows(logits, path).float(), -1)  # [N, L, V]
        committed = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # accepted nodes below the root, then a pad
        committed = committed.scatter(1, (num_accepted - 1)[:, None], bonus[:, None])
        chosen = logp.gather(-1, committed[..., None]).squeeze(-1)
        top_lp, top_ids = logp.topk(k, -1) if k else (logp[..., :0], committed[..., None][..., :0])
        return chosen, top_ids, top_lp

    def track_context(self, seqs: list[Sequence], kind: StepKind, after: Launched | None) -> None:
        """Before a round: a plain-decoding round that defers the drafter's context marks where
        the deferred positions start; a speculative round first projects the deferred ones
        (every position from ``context_from`` up to its root was a prompt token or the root of a
        deferred plain round: its taps are in the tap cache)."""
        if kind.method == "ar":
            if kind.store_context:
                for s in seqs:
                    if s.context_from is None:  # behind an unread tree, the root is not known yet
                        s.context_from = len(s) - 1 if after is None else CONTEXT_PENDING
            return
        lo, hi, tables = [], [], []
        for s in seqs:
            if s.context_from is None:
                continue
            assert s.context_from != CONTEXT_PENDING, "the round before the last was not read"
            # Deferred positions mean the last round launched for s was plain (1 token) or none was.
            lo.append(s.context_from)
            hi.append(len(s) - 1 + (after is not None))
            tables.append(s.block_table)
            s.context_from = None
        if lo:
            self.catch_up(*position_slots(lo, hi, tables, self.blocks.block_size))

    def catch_up(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """Project deferred positions' taps into the drafter's context, on the stream without a
        sync. Under CUDA graphs a captured replay per bucket of tokens: the next round is launched
        behind an unread one, and eagerly these dozen launches took ~1 ms of host time on the
        H200 (longer than the plain round they ran behind), whatever the number of tokens."""
        n = len(slots)
        self.caught_up_tokens += n
        if not self.use_graphs:
            both = torch.from_numpy(np.stack([slots, positions])).to(self.device)
            self.store_deferred(both[0], both[1])
            return
        top = CATCH_UP_BUCKETS[-1]
        for i in range(0, n, top):
            part = min(n - i, top)
            self.catch_up_graph(next(b for b in CATCH_UP_BUCKETS if b >= part)).run(
                slots[i:i + part], positions[i:i + part])

    def store_deferred(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.drafter.store_context(self.tap_cache[slots], positions, self.drafter_kv, slots)

    def catch_up_graph(self, tokens: int) -> "CatchUpGraph":
        graph = self.catch_up_graphs.get(tokens)
        if graph is None:
            graph = self.catch_up_graphs[tokens] = CatchUpGraph(self, tokens, self.catch_up_pool)
        return graph

    @property
    def num_captured(self) -> int:
        return len(self.graphs) + len(self.prefill_graphs) + len(self.catch_up_graphs)

    def finish(self, launched: Launched) -> list[list[int]]:
        """Wait for a launched round and read it (the one sync of a step); returns the tokens each
        sequence commits and advances its cached length."""
        if launched.event is not None:
            launched.event.synchronize()
        n = len(launched.seqs)
        packed = launched.packed[:n].tolist()
        if launched.graph is not None and launched.graph.events:
            for name, sec in zip(STAGES, launched.graph.stage_seconds()):
                self.stage_seconds[name] += sec
        out, launched.path_nodes = [], []
        for seq, row in zip(launched.seqs, packed):
            k, L = row[0], (len(row) - 3) // 2
            seq.num_cached += k
            if seq.context_from == CONTEXT_PENDING:  # a deferred round behind this one: its root
                seq.context_from = seq.num_cached
            seq.stop_ahead = bool(row[2])
            out.append(row[4:3 + k] + [row[1]])
            launched.path_nodes.append(row[4 + L:3 + L + k])
        if launched.logprobs is not None:
            chosen, top_ids, top_lp = (t[:n].tolist() for t in launched.logprobs)
            launched.token_logprobs = [
                None if seq.params.logprobs is None else
                [(chosen[i][j], list(zip(top_ids[i][j], top_lp[i][j]))[:seq.params.logprobs])
                 for j in range(len(out[i]))]
                for i, seq in enumerate(launched.seqs)]
        return out

    def pack(self, state: dict) -> torch.Tensor:
        """A round's outputs in one tensor (``pack_outputs``), with each row's ``stop_ahead``: an
        EOS token among the tree's tokens or the target's tokens at its nodes. The tree drafts
        past what a round accepts, so the flag says that EOS is probably near: the engine then
        does not launch a round behind the next one, which would likely be dropped (see
        ``LLMEngine._ends_soon``)."""
        tree, verified = state["tree"], state["verified"]
        stop_ids = self.stop_ids()
        seen = (tree.tokens[..., None] == stop_ids).flatten(1).any(1)
        if verified.samples is not None:
            seen |= (verified.samples[..., None] == stop_ids).flatten(1).any(1)
        return pack_outputs(*state["out"], state["accepted"][0], seen.long())

    def stop_ids(self) -> torch.Tensor:
        """The EOS ids as a device tensor (kept: a captured graph reads the same one)."""
        key = tuple(sorted(self.eos_token_ids)) or (-1,)
        if self._stop_ids is None or self._stop_ids[0] != key:
            self._stop_ids = (key, torch.tensor(key, dtype=torch.long, device=self.device))
        return self._stop_ids[1]

    def key_bounds(self, bucket: int) -> list[int]:
        """The key bounds rounds of ``bucket`` sequences are captured for, ascending."""
        small = [b for b in GRAPH_KEY_BOUNDS if b < self.max_context] if bucket <= KEY_BOUND_BATCH else []
        return small + [self.max_context]

    def key_bound(self, bucket: int, max_keys: int) -> int:
        """The smallest key bound that holds a round with up to ``max_keys`` keys a sequence."""
        return next((b for b in self.key_bounds(bucket) if max_keys <= b), self.max_context)

    def _graph(self, kind: StepKind, bucket: int, max_keys: int) -> StepGraph:
        key = (kind, bucket, max_keys, self.profile_stages)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = StepGraph(self, kind, bucket, self.graph_pool, self.profile_stages, max_keys)
        return graph

    def round_graph(self, method: str, budget: int, bucket: int, sampling: str, max_keys: int,
                    store_context: bool = True) -> StepGraph:
        """The step graph of a round (captured if needed); ``sampling``: "greedy", "sample" or
        "filtered" (``step_kind``); ``store_context``: as ``launch`` (auto's rounds store it)."""
        kind = StepKind(method, budget if method == "ddtree" else 0, sampling,
                        store_context and self.drafter_kv is not None)
        return self._graph(kind, bucket, max_keys)

    @torch.inference_mode()
    def time_graph(self, method: str, budget: int, bucket: int, greedy: bool = True, reps: int = 10,
                   context: int = 512) -> float:
        """Seconds per replay of a step graph on padding rows at position ``context`` (so attention
        reads a realistic prefix), the graph of the key bound a round there replays."""
        context = max(0, min(context, self.max_context - self.lookahead(method, budget) - 1))
        max_keys = self.key_bound(bucket, context + self.lookahead(method, budget) + 1)
        return self.round_graph(method, budget, bucket, "greedy" if greedy else "sample", max_keys).replay_seconds(
            context, reps)

    def round_stages(self, kind: StepKind, inp: StepInputs, max_keys: int, state: dict,
                     seqs: list[Sequence] | None = None, generators=None, need_logits: bool = False,
                     processing: Processing | None = None):
        """The round as six closures over ``state`` (one graph each when profiling stages);
        ``processing``: the verify stage processes the logits (the raw ones stay in state)."""
        def draft():
            state["logprobs"] = self.draft(kind, inp, max_keys, seqs, raw=True)

        def build():
            state["tree"] = self.build(kind, inp.roots, state["logprobs"])

        def verify():
            state["verified"] = verified = self.verify(kind, inp, state["tree"], max_keys, generators, need_logits)
            if processing is not None:  # (a new tensor: the raw logits stay for logprobs)
                tree, raw, rows = state["tree"], verified.logits, processing.rows
                ancestors = tree.ancestors[rows] if tree.ancestors is not None else None
                state["raw_logits"] = raw
                state["verified"] = verified._replace(logits=raw.index_copy(0, rows, process_tree_logits(
                    raw[rows], tree.tokens[rows], tree.depths[rows], ancestors, processing)))

        def accept():
            state["accepted"] = self.accept(kind, inp, state["tree"], state["verified"], generators)

        def commit():
            state["out"], state["dst"] = self.commit(kind, state["tree"], state["accepted"], state["verified"].slots)

        def context():
            self.update_context(kind, inp, state["accepted"][0], state["verified"].taps, state["dst"])

        return draft, build, verify, accept, commit, context

    @torch.inference_mode()
    def draft_for(self, seqs: list[Sequence]) -> torch.Tensor:
        """The drafter's per-depth log-probabilities for these sequences' next block (eager; for
        tests and tools)."""
        kind = self.step_kind(seqs, "dflash", 0, store_context=False)  # every depth
        return self.draft(kind, self._inputs(seqs), max(len(s) for s in seqs) + self.drafter.block_size, seqs)

    def draft(self, kind: StepKind, inp: StepInputs, max_keys: int, seqs, raw: bool = False) -> torch.Tensor | None:
        """Per-depth log-probabilities [N, D, V] from the drafter (fp32, temperature 1). ``raw``: on
        the Triton path what ``build`` reads instead: the tree's logits (its top-k normalises the
        few entries it keeps, so a log-softmax over [N, D, V] would go unread: 0.10 ms at batch 64
        and 8 depths on the H200), the chain's argmax tokens [N, D] (from the fused LM head)."""
        if kind.method == "ar":
            return None
        if not isinstance(self.drafter, DFlashDrafter):
            return self.drafter.draft_logprobs(seqs).to(self.device)
        S, N = self.drafter.block_size, inp.roots.shape[0]
        embeds = self.drafter.block_embeddings(inp.roots, self.target.model.embed_tokens)
        ctx = AttentionContext.uniform(inp.tables, inp.starts, S, self.blocks.block_size, max_keys, mask="full",
                                       rope_table=self.drafter_rope)
        hidden = self.drafter(embeds, ctx.positions, self.drafter_kv, ctx).view(N, S, -1)[:, 1:1 + self.draft_depth(kind)]
        hidden = hidden.to(self.dtype)
        if raw and kind.method == "dflash" and triton_enabled(hidden):
            # the chain reads only each depth's argmax: the fused LM head returns it, no logits
            from ddtree.kernels.triton_lm_head import lm_head_sample_triton
            D = hidden.shape[1]
            return lm_head_sample_triton(hidden.reshape(N * D, -1), self.target.lm_head.weight, inp.temperature,
                                         self.sample_seed, D, sampling=False).view(N, D)
        logits = self.target.logits(hidden)
        return logits if raw and triton_enabled(logits) else torch.log_softmax(logits, -1)

    def draft_depth(self, kind: StepKind) -> int:
        """Depths whose logits a round reads: S-1, or b for a tree of b < S-1 nodes (it reaches
        depth b at most; the deeper positions' LM head, log-softmax and top-k would go unread)."""
        S = self.drafter.block_size
        return min(S - 1, kind.budget) if kind.method == "ddtree" else S - 1

    def build(self, kind: StepKind, roots: torch.Tensor, logprobs) -> Tree:
        """The tree to verify, root first, with its ancestor mask."""
        N = roots.shape[0]
        if kind.method == "ddtree" and triton_enabled(logprobs):
            from ddtree.kernels.triton_tree import build_tree_triton
            # (logits from draft(raw=True), or a non-DFlash drafter's log-probs: normalising those
            # again changes nothing)
            tokens, parents, depths, ancestors = build_tree_triton(logprobs, kind.budget, roots, normalize=True)
            return Tree(tokens, parents, depths, min(logprobs.shape[1], tokens.shape[1] - 1), ancestors)
        if kind.method == "ar":
            empty = torch.zeros(N, 0, dtype=torch.long, device=self.device)
            tokens, parents, depths, max_depth = empty, empty, empty, 0
        elif kind.method == "dflash":  # (from draft(raw=True) on the Triton path: the argmax tokens)
            tokens, parents, depths = chain_tree(logprobs)
            max_depth = logprobs.shape[1]
        else:
            tokens, parents, depths = build_tree_batched(logprobs, kind.budget)
            max_depth = logprobs.shape[1]
        tokens, parents, depths = with_root(roots, tokens, parents, depths)
        T, max_depth = tokens.shape[1], min(max_depth, tokens.shape[1] - 1)
        if kind.method == "ddtree":
            ancestors = ancestor_mask(parents, max_depth)
        elif kind.method == "dflash":  # a chain's ancestor mask is causal
            ancestors = torch.ones(T, T, dtype=torch.bool, device=self.device).tril().expand(N, T, T)
        else:  # plain decoding: the root alone, no walk
            ancestors = None
        return Tree(tokens, parents, depths, max_depth, ancestors)

    def verify(self, kind: StepKind, inp: StepInputs, tree: Tree, max_keys: int, generators=None,
               need_logits: bool = False) -> "Verified":
        """One target pass over root + all nodes with the ancestor mask and depth positions. On
        CUDA, unless the round filters (top-k / top-p), a request brings its own generator or
        the logits are needed (logprobs), the LM head samples in its epilogue
        (``lm_head_sample_triton``): the round's per-node target tokens come back instead of
        [N, T, V] fp32 logits."""
        N, T = tree.tokens.shape
        if kind.method == "ddtree":
            ctx = AttentionContext.uniform(inp.tables, inp.starts, T, self.blocks.block_size, max_keys,
                                           mask="tree", tree_mask=tree.ancestors, depths=tree.depths,
                                           rope_table=self.target_rope)
        else:  # a chain's mask is causal and its node k sits at depth k
            ctx = AttentionContext.uniform(inp.tables, inp.starts, T, self.blocks.block_size, max_keys,
                                           rope_table=self.target_rope)
        taps = self.taps if (kind.method != "ar" or kind.store_context) else ()
        hidden, tapped = self.target(tree.tokens.reshape(-1), ctx.positions, self.target_kv, ctx, taps)
        tapped = tapped.view(N, T, -1) if tapped is not None else None
        slots = ctx.slot_mapping.view(N, T)
        if (kind.sampling != "filtered" and not need_logits and triton_enabled(hidden)
                and (generators is None or all(g is None for g in generators))):
            from ddtree.kernels.triton_lm_head import lm_head_sample_triton
            samples = lm_head_sample_triton(hidden.reshape(N * T, -1), self.target.lm_head.weight,
                                            inp.temperature, self.sample_seed, T, kind.sampling == "sample")
            return Verified(None, samples.view(N, T), tapped, slots)
        return Verified(self.target.logits(hidden).view(N, T, -1), None, tapped, slots)

    def accept(self, kind: StepKind, inp: StepInputs, tree: Tree, verified: "Verified", generators):
        samples = verified.samples
        if samples is None:
            samples = sample_from_logits(verified.logits, inp.temperature, inp.top_k, inp.top_p, generators,
                                         all_greedy=kind.sampling == "greedy",
                                         use_filters=kind.sampling == "filtered")
        if kind.method == "ar":  # a root-only tree: the walk's answer without its kernels
            path = torch.zeros_like(tree.tokens)
            return path, torch.ones_like(inp.roots), samples[:, 0]
        if triton_enabled(samples):  # one launch instead of ~18 small ones
            from ddtree.kernels.triton_tree import accept_walk_triton
            return accept_walk_triton(tree.tokens, tree.parents, tree.depths, samples, tree.max_depth)
        return accept_walk(tree.tokens, tree.parents, tree.depths, samples, tree.max_depth, tree.ancestors)

    def commit(self, kind: StepKind, tree: Tree, accepted, slots):
        """Move accepted K/V into chain order (the compaction); returns ((tokens [N, L] root first,
        num_accepted [N], bonus [N]), the accepted nodes' slots [N, L]) without reading them."""
        path, num_accepted, bonus = accepted
        if kind.method == "ar":  # the root is already in place
            return (tree.tokens, num_accepted, bonus), slots
        dst = slots[:, :path.shape[1]]  # accepted node k ends at the tree's k-th slot
        if kind.method == "ddtree" and triton_enabled(self.target_kv):
            from ddtree.kernels.triton_tree import compact_kv_triton
            compact_kv_triton(self.target_kv, path, num_accepted, slots)
        elif kind.method == "ddtree":  # a chain's accepted nodes are already in chain order
            src_off, _, move = compaction_moves(path, num_accepted)
            src = torch.where(move, gather_rows(slots, src_off), dst).reshape(-1)
            self.target_kv[:, :, dst.reshape(-1)] = self.target_kv[:, :, src]
        return (gather_rows(tree.tokens, path), num_accepted, bonus), dst

    def update_context(self, kind: StepKind, inp: StepInputs, path: torch.Tensor, taps,
                       dst: torch.Tensor) -> None:
        """Extend the drafter's context with the accepted nodes' tapped target features. Rows past
        the accepted length write harmless context beyond the committed prefix."""
        if taps is None or self.drafter_kv is None:
            return
        if kind.method == "ar" and self.tap_cache is not None:  # deferred: see catch_up
            self.tap_cache[dst[:, 0]] = taps[:, 0]
            return
        # The accepted nodes' slots (dst) are the first L of the verified tree's: the slots of L
        # new tokens from the root on, made here with their positions and rotary rows.
        ctx = AttentionContext.uniform(inp.tables, inp.starts, path.shape[1], self.blocks.block_size, 0,
                                       rope_table=self.drafter_rope)
        self.drafter.store_context(gather_rows(taps, path).reshape(-1, taps.shape[-1]), ctx.positions,
                                   self.drafter_kv, ctx.slot_mapping, ctx.rope)
