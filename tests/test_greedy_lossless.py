"""Greedy losslessness: DFlash chain and DDTree emit exactly the AR token ids (SmolLM2, fp32, CPU)."""
import pytest
import torch

from ddtree.engine.llm import SHIPPED_DRAFTERS

from ddtree import SamplingParams

from conftest import GREEDY_64, make_llm
from oracle import OracleDrafter


def _check_equal(prompts, outs, ar_reference):
    for p, o in zip(prompts, outs):
        assert o.token_ids == ar_reference[tuple(p)], f"diverged for prompt of {len(p)} tokens"
        assert len(o.token_ids) == 64
        assert sum(o.metrics.accepted_lengths) == 64


SHIPPED = SHIPPED_DRAFTERS / "SmolLM2-135M-Instruct-DFlash"


@pytest.mark.parametrize("method,budget,drafter", [("dflash", 0, "random"), ("ddtree", 4, "random"),
                                                   ("ddtree", 12, "random"), ("dflash", 0, "shipped"),
                                                   ("ddtree", 16, "shipped")])
def test_mixed_batch(smol, tokenizer, prompts, ar_reference, method, budget, drafter):
    llm = make_llm(smol, tokenizer, method=method, budget=budget,
                   drafter=SHIPPED if drafter == "shipped" else drafter)
    outs = llm.generate(prompts, GREEDY_64)
    _check_equal(prompts, outs, ar_reference)
    if drafter == "shipped":  # the trained drafter is loaded right and actually helps
        lens = [n for o in outs for n in o.metrics.accepted_lengths]
        assert sum(lens) / len(lens) > (1.3 if method == "dflash" else 1.6)


def test_small_tree_drafts_only_its_depths(smol, tokenizer, prompts):
    """An 8-node tree drafts 8 depths, not the block's 15, and accepts exactly what the tree
    built from all 15 accepts (the same trees, round for round)."""
    llm = make_llm(smol, tokenizer, method="ddtree", budget=8, drafter=SHIPPED)
    seen = []
    draft = llm.engine.runner.draft
    llm.engine.runner.draft = lambda kind, *a, **kw: seen.append(out := draft(kind, *a, **kw)) or out
    cut = llm.generate(prompts[:3], GREEDY_64)
    full = make_llm(smol, tokenizer, method="ddtree", budget=8, drafter=SHIPPED)
    full.engine.runner.draft_depth = lambda kind: full.engine.runner.drafter.block_size - 1
    whole = full.generate(prompts[:3], GREEDY_64)
    assert {t.shape[1] for t in seen} == {8}
    assert [o.metrics.accepted_lengths for o in cut] == [o.metrics.accepted_lengths for o in whole]
    assert [o.token_ids for o in cut] == [o.token_ids for o in whole]


@pytest.fixture(scope="module")
def oracle_runs(smol, tokenizer, prompts, ar_reference):
    runs = {}
    for method, budget in [("dflash", 0), ("ddtree", 8), ("ddtree", 48)]:
        oracle = OracleDrafter(ar_reference, smol.config.vocab_size, block_size=8, seed=1)
        llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=oracle)
        runs[method, budget] = llm.generate(prompts, GREEDY_64)
    return runs


def test_oracle_drafter_lossless(prompts, ar_reference, oracle_runs):
    for outs in oracle_runs.values():
        _check_equal(prompts, outs, ar_reference)


def test_oracle_drafter_exercises_long_paths_and_branches(oracle_runs):
    def tau(outs):
        lens = [n for o in outs for n in o.metrics.accepted_lengths]
        return sum(lens) / len(lens), max(lens)

    chain_tau, _ = tau(oracle_runs["dflash", 0])
    tree_tau, tree_max = tau(oracle_runs["ddtree", 48])
    assert chain_tau > 2.0
    assert tree_max == 8  # a full-depth path (7 drafted + bonus) was accepted
    # The chain cannot use the true token when it is ranked second; the tree can.
    assert tree_tau > chain_tau + 0.5


def test_batch_one(smol, tokenizer, prompts, ar_reference):
    oracle = OracleDrafter(ar_reference, smol.config.vocab_size, block_size=8, seed=2)
    for drafter in ("random", oracle):
        llm = make_llm(smol, tokenizer, method="ddtree", budget=16, drafter=drafter)
        for p in (prompts[16], prompts[17]):  # the shortest and the longest prompt
            _check_equal([p], llm.generate([p], GREEDY_64), ar_reference)


def test_chunked_prefill_preemption_and_mixed_methods(smol, tokenizer, prompts, ar_reference):
    """A KV pool too small for all requests forces preemption (recompute); prompts are prefilled
    in 16-token chunks; requests in one batch use different methods and budgets."""
    oracle = OracleDrafter(ar_reference, smol.config.vocab_size, block_size=8, seed=3)
    llm = make_llm(smol, tokenizer, method="ddtree", budget=24, drafter=oracle, max_model_len=160,
                   kv_cache_gb=0.013, max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.blocks.num_blocks * engine.blocks.block_size < 8 * 130  # cannot hold all at once
    seqs = []
    settings = [("ar", 0), ("dflash", 0), ("ddtree", 24), ("ddtree", 3)]
    for i, p in enumerate(prompts[:8]):
        method, budget = settings[i % 4]
        seqs.append(engine.add_request(p, GREEDY_64, method=method, budget=budget))
    preempted = False
    while engine.has_unfinished():
        engine.step()
        preempted |= any(s.num_cached == 0 and s.num_output_tokens > 0 for s in engine.scheduler.waiting)
    assert preempted
    assert engine.blocks.num_free == engine.blocks.num_blocks
    _check_equal(prompts[:8], [engine.output(s) for s in seqs], ar_reference)


@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 12), ("ddtree", "auto")])
def test_overlapped_rounds(smol, tokenizer, prompts, ar_reference, method, budget):
    """With overlap_steps each round is launched from the previous round's device outputs before
    the host reads them (the CUDA path's pipelining, run eagerly here): outputs stay AR-exact, and
    rounds really were launched that way."""
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16)
    chosen = [prompts[i] for i in (0, 5, 16, 17)]
    _check_equal(chosen, llm.generate(chosen, GREEDY_64), ar_reference)
    batched = llm.engine.overlapped_rounds
    assert batched > 5
    one = llm.generate([prompts[3]], GREEDY_64)  # batch of one, then a fresh batch reuses the blocks
    _check_equal([prompts[3]], one, ar_reference)
    assert llm.engine.overlapped_rounds > batched + 5
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks  # no block leaked


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 12)])
def test_overlapped_rounds_with_mixed_lengths(smol, tokenizer, prompts, ar_reference, method, budget):
    """Requests of different lengths: a round is launched behind the previous one even when a
    request may reach max_tokens within it (that request drops the round's tokens), so only the
    first round, the rounds right after a request finished and the last request's held rounds
    (see test_no_round_behind_a_requests_last) run unoverlapped."""
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16)
    chosen, lengths = [prompts[i] for i in (0, 5, 16, 17)], [9, 23, 40, 64]
    calls0 = llm.engine.runner.decode_calls
    outs = llm.generate(chosen, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    for p, o, n in zip(chosen, outs, lengths):
        assert o.token_ids == ar_reference[tuple(p)][:n] and o.finish_reason == "length"
        assert sum(o.metrics.accepted_lengths) == n
    fresh = llm.engine.runner.decode_calls - calls0 - llm.engine.overlapped_rounds
    assert fresh <= 1 + len(chosen) + llm.engine.held_rounds, fresh
    assert llm.engine.held_rounds <= (1 if method == "ar" else 6), llm.engine.held_rounds
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_overlapped_rounds_stop_and_abort(smol, tokenizer, prompts, ar_reference):
    """A request that stops (stop token) or is aborted while the next round is in flight drops
    that round's tokens; the others continue AR-exact."""
    llm = make_llm(smol, tokenizer, method="dflash", budget=0, drafter=SHIPPED, overlap_steps=True)
    engine = llm.engine
    ref = [ar_reference[tuple(p)] for p in prompts[:3]]
    stop_tok = ref[0][20]
    stopped = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                            stop_token_ids=[stop_tok]))
    aborted = engine.add_request(prompts[1], GREEDY_64)
    kept = engine.add_request(prompts[2], GREEDY_64)
    while aborted.num_output_tokens < 10:
        engine.step()
    assert engine._inflight is not None
    engine.abort(aborted.request_id)
    while engine.has_unfinished():
        engine.step()
    assert stopped.output_token_ids == ref[0][:ref[0].index(stop_tok) + 1]
    assert stopped.finish_reason == "stop"
    assert aborted.finish_reason == "abort" and aborted.output_token_ids == ref[1][:aborted.num_output_tokens]
    assert kept.output_token_ids == ref[2]
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 12)])
def test_no_round_behind_a_requests_last(smol, tokenizer, prompts, ar_reference, method, budget):
    """A request alone: once the round in flight will probably reach max_tokens (plain decoding:
    its last token; a tree: 1 in 20 of its recent rounds committed what is left), no round is
    launched behind it, so none is dropped for the next request to wait on."""
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16)
    engine = llm.engine
    for i, n in ((0, 40), (5, 37)):
        out, = llm.generate([prompts[i]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert out.token_ids == ar_reference[tuple(prompts[i])][:n]
    assert engine.dropped_rounds == 0
    assert engine.overlapped_rounds > 10
    if method == "ar":  # each request's last round only
        assert engine.held_rounds == 2
    else:
        assert 2 <= engine.held_rounds <= 8, engine.held_rounds


def test_no_round_behind_a_tree_that_saw_eos(smol, tokenizer, prompts, ar_reference):
    """EOS in a round's tree (drafted, or the target's token at a node) holds the next round
    back: the request that ends at EOS drops no round. (A token of the reference output stands
    in for EOS.)"""
    llm = make_llm(smol, tokenizer, method="ddtree", budget=12, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16)
    engine = llm.engine
    ref = ar_reference[tuple(prompts[2])]
    eos = ref[30]
    engine.eos_token_ids = engine.runner.eos_token_ids = {eos}
    out, = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=64))
    assert out.token_ids == ref[:ref.index(eos) + 1] and out.finish_reason == "stop"
    assert engine.dropped_rounds == 0 and engine.held_rounds >= 1
    # ignore_eos: the flag does not hold rounds back
    held = engine.held_rounds
    out, = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert out.token_ids == ref[:20]
    assert engine.held_rounds - held <= 4


class _FakeEvent:
    def __init__(self, *a, **k):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


def _emulated_step_graph(runner_mod):
    """StepGraph with its captured graph replaced by re-running the round on the static buffers
    and copying the results into the persistent outputs (what a replay does): the graph path's
    bookkeeping (static inputs, padding rows, slots, device-side chaining, packing) on the CPU."""
    StepGraph = runner_mod.StepGraph

    class Emulated(StepGraph):
        def __init__(self, runner, kind, n, pool, split, max_keys):
            self.n, self.width = n, runner.table_width
            self.scratch = runner_mod.np.array(runner.scratch[:self.width], dtype=runner_mod.np.int64)
            self.h_ints = [torch.zeros(n, 3 + self.width, dtype=torch.long) for _ in range(2)]
            self.h_floats = [torch.zeros(n, 2, dtype=torch.float32) for _ in range(2)]
            self.ints, self.floats = torch.zeros_like(self.h_ints[0]), torch.zeros_like(self.h_floats[0])
            self._fill_padding(0, 0, 0)
            self._upload(0)
            self.inputs = runner_mod.StepInputs(self.ints[:, 0], self.ints[:, 1], self.ints[:, 3:],
                                                self.floats[:, 0], self.ints[:, 2], self.floats[:, 1])
            state = {}
            stages = runner.round_stages(kind, self.inputs, max_keys, state)
            for fn in stages:
                fn()
            _, self.num_accepted, self.bonus = (t.clone() for t in state["out"])
            self.packed = runner.pack(state)
            graph = self

            class Replay:
                def replay(self):
                    for fn in stages:
                        fn()
                    _, acc, bonus = state["out"]
                    graph.num_accepted.copy_(acc)
                    graph.bonus.copy_(bonus)
                    graph.packed.copy_(runner.pack(state))

            self.graphs, self.events = [Replay()], []
            self.h_out = [torch.zeros(self.packed.shape, dtype=torch.long) for _ in range(2)]

    return Emulated


def _emulated_catch_up_graph(runner_mod):
    """CatchUpGraph whose captured graph is the eager store on its padded static buffer."""
    class Emulated(runner_mod.CatchUpGraph):
        def __init__(self, runner, tokens, pool):
            self.tokens = tokens
            self.pad_slot = runner.scratch[0] * runner.blocks.block_size
            self.host = torch.zeros(2, tokens, dtype=torch.long)
            self.ints = torch.zeros_like(self.host)
            self.uploaded = _FakeEvent()
            ints = self.ints

            class Replay:
                def replay(self):
                    runner.store_deferred(ints[0], ints[1])

            self.graph = Replay()

    return Emulated


@pytest.mark.parametrize("method,budget,batch", [("dflash", 0, (0, 5, 16)), ("ddtree", 12, (17,)),
                                                 ("ddtree", "auto", (16,)), ("ddtree", 12, (0, 5, 16))])
def test_graph_path_bookkeeping_emulated(smol, tokenizer, prompts, ar_reference, method, budget, batch,
                                         monkeypatch):
    """The CUDA-graph round's bookkeeping, emulated on the CPU: batches padded to buckets,
    static-buffer inputs, overlapped rounds chained on the device; AR-exact outputs."""
    from ddtree.engine import runner as runner_mod
    monkeypatch.setattr(runner_mod, "StepGraph", _emulated_step_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "CatchUpGraph", _emulated_catch_up_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "PREFILL_BUCKETS", ())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16, max_model_len=256)
    llm.engine.runner.use_graphs = True
    chosen = [prompts[i] for i in batch]  # 3 sequences run in a bucket of 4
    _check_equal(chosen, llm.generate(chosen, GREEDY_64), ar_reference)
    assert llm.engine.runner.graphs
    assert llm.engine.overlapped_rounds > 5
    if budget == "auto":  # auto tries plain rounds (deferred context), then padded catch-ups ran
        assert llm.engine.runner.catch_up_graphs and llm.engine.runner.caught_up_tokens


def test_graph_rounds_pick_their_key_bound_emulated(smol, tokenizer, prompts, ar_reference, monkeypatch):
    """Rounds of small batches replay the graph captured for the smallest key bound that holds
    their keys (GRAPH_KEY_BOUNDS, here small enough that the sequences cross several as they grow,
    overlapped rounds included). The CPU's padded reference attention reads only a round's bound of
    keys, so a bound below a round's keys drops keys and breaks AR equality."""
    from ddtree.engine import runner as runner_mod
    monkeypatch.setattr(runner_mod, "StepGraph", _emulated_step_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "CatchUpGraph", _emulated_catch_up_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "PREFILL_BUCKETS", ())
    monkeypatch.setattr(runner_mod, "GRAPH_KEY_BOUNDS", (64, 96, 128))
    monkeypatch.setattr(runner_mod, "KEY_BOUND_BATCH", 2)  # the two sequences below run in bucket 2
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    llm = make_llm(smol, tokenizer, method="ddtree", budget=12, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16, max_model_len=256)
    runner = llm.engine.runner
    runner.use_graphs = True
    chosen = [prompts[i] for i in (0, 5)]
    _check_equal(chosen, llm.generate(chosen, GREEDY_64), ar_reference)
    assert {bound for _, _, bound, _ in runner.graphs} == {64, 96, 128, runner.max_context}
    assert llm.engine.overlapped_rounds > 5
    assert runner.key_bounds(4) == [runner.max_context]  # larger batches: the context limit only
    assert runner.key_bound(2, 97) == 128 and runner.key_bound(2, 129) == runner.max_context


def test_graphs_captured_up_front_cover_every_round_emulated(smol, tokenizer, prompts, ar_reference, monkeypatch):
    """``capture_graphs`` (the server before serving, ``ddtree bench`` before a fixed method's
    runs) captures every graph a fixed method's rounds replay: each batch bucket and each key bound
    the sequences grow through. Generating afterwards captures nothing more (a capture while
    serving stalls every stream) and stays AR-exact."""
    from ddtree.engine import llm_engine, runner as runner_mod
    monkeypatch.setattr(runner_mod, "StepGraph", _emulated_step_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "CatchUpGraph", _emulated_catch_up_graph(runner_mod))
    monkeypatch.setattr(runner_mod, "PREFILL_BUCKETS", ())
    monkeypatch.setattr(llm_engine, "PREFILL_BUCKETS", ())  # (prefill graphs need CUDA)
    monkeypatch.setattr(runner_mod, "GRAPH_KEY_BOUNDS", (64, 96, 128))
    monkeypatch.setattr(runner_mod, "KEY_BOUND_BATCH", 2)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    llm = make_llm(smol, tokenizer, method="ddtree", budget=12, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16, max_model_len=256, max_num_seqs=2)
    runner = llm.engine.runner
    runner.use_graphs = True
    llm.engine.capture_graphs([("ddtree", 12, False)])
    captured = set(runner.graphs)
    assert {(bucket, bound) for _, bucket, bound, _ in captured} == {
        (b, k) for b in (1, 2) for k in (64, 96, 128, runner.max_context)}
    chosen = [prompts[i] for i in (0, 5)]
    _check_equal(chosen, llm.generate(chosen, GREEDY_64), ar_reference)
    assert set(runner.graphs) == captured and llm.engine.overlapped_rounds > 5


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 12)])
def test_joins_wait_under_load(smol, tokenizer, prompts, ar_reference, method, budget):
    """A request arriving at a running batch waits join_wait_rounds rounds for a group (rounds
    keep being launched behind unread ones meanwhile), then joins; two arriving together join at
    the next round. Every output stays AR-exact."""
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED, overlap_steps=True,
                   max_budget=16, max_num_seqs=6, join_wait_rounds=5)
    engine = llm.engine
    engine.scheduler.join_group = 2  # a batch of 3 wants 2 joiners (16 at the real group size)
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    seqs = [engine.add_request(p, params(60)) for p in prompts[:3]]
    while engine.scheduler.rounds < 3:
        engine.step()
    seqs.append(late := engine.add_request(prompts[3], params(20)))
    arrived, overlapped = engine.scheduler.rounds, engine.overlapped_rounds
    while late.status.value == "waiting":
        engine.step()
    assert 5 <= engine.scheduler.rounds - arrived <= 6
    assert engine.overlapped_rounds > overlapped  # the batch did not stop for it
    pair = [engine.add_request(p, params(20)) for p in prompts[4:6]]
    arrived = engine.scheduler.rounds
    while any(s.status.value == "waiting" for s in pair):
        engine.step()
    assert engine.scheduler.rounds - arrived <= 2
    seqs += pair
    while engine.has_unfinished():
        engine.step()
    for seq, n in zip(seqs, [60, 60, 60, 20, 20, 20]):
        assert engine.output(seq).token_ids == ar_reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][:n]
    assert engine.scheduler.joins == 2 and engine.blocks.num_free == engine.blocks.num_blocks
