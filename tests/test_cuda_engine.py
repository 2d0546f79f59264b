"""The CUDA-only engine paths against the eager ones (fp32, random weights; run on the GPU
machine, skipped elsewhere): captured prefill steps (one and several sequences) and overlapped
graph rounds must give the tokens of eager, one-round-at-a-time decoding, and prompt lengths must
not recompile kernels."""
import itertools

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.projection import random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512,
             num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
             tie_word_embeddings=True, attention_bias=False, qk_norm=False)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target, drafter = random_model(SHAPE, 2, 8, "cuda", torch.float32)
    with torch.no_grad():  # sharper logits than the 0.02 init: no near-ties in greedy choices
        target.lm_head.weight.mul_(20)
    return target, drafter


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 64, 100, 250, 700, 33][:n]  # several buckets
    return [torch.randint(1, 4096, (k,), generator=g).tolist() for k in lengths]


def _run(models, method, budget, graphs, overlap, prompts, batched, lengths=None):
    target, drafter = models
    llm = LLM(target=target, drafter=drafter if method != "ar" else None, method=method, budget=budget,
              device="cuda", dtype=torch.float32, max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5,
              cuda_graphs=graphs, overlap_steps=overlap, max_budget=32)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    if lengths is not None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    if batched:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    else:
        outs = [llm.generate([p], params)[0].token_ids for p in prompts]
    return outs, llm


# Budget 32 with 3 query heads per KV head: a tree takes several query tiles of the attention
# kernel (the layout that once wrote past a sequence's last query on the H200).
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 32), ("ddtree", "auto")])
def test_graphs_and_overlap_match_eager(models, method, budget):
    prompts = _prompts(8)
    eager, _ = _run(models, method, budget, graphs=False, overlap=False, prompts=prompts, batched=False)
    for batched in (False, True):
        fast, llm = _run(models, method, budget, graphs=True, overlap=True, prompts=prompts, batched=batched)
        assert fast == eager
        assert llm.engine.overlapped_rounds > 10
        captured = set(llm.engine.runner.prefill_graphs)  # (tokens, sequences) buckets
        if batched:  # the 8 prompts are prefilled together: 1,201 tokens
            assert (2048, 16) in captured
        else:
            assert {(t, 1) for t in (16, 32, 64, 128, 256, 1024)} <= captured
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    # Mixed lengths, batched: rounds stay overlapped while requests finish inside them.
    lengths = [64, 20, 37, 64, 9, 50, 64, 30]
    mixed, llm = _run(models, method, budget, graphs=True, overlap=True, prompts=prompts, batched=True,
                      lengths=lengths)
    assert mixed == [e[:n] for e, n in zip(eager, lengths)]
    assert llm.engine.runner.decode_calls - llm.engine.overlapped_rounds <= 1 + len(prompts)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def _compiled_variants(kernel) -> int:
    # device_caches[device][0] is Triton's compiled-kernel dict (3.x): one entry per specialisation
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_prompt_lengths_do_not_recompile_attention(models):
    from ddtree.kernels import triton_attention
    kernel = triton_attention._tree_attention_kernel
    _run(models, "ddtree", 16, graphs=False, overlap=False, prompts=_prompts(3, seed=1), batched=False)  # BLOCK_M 16, 32, 64
    before = _compiled_variants(kernel)
    assert before > 0
    base = _prompts(1, seed=2)[0]
    _run(models, "ddtree", 16, graphs=False, overlap=False, batched=False,
         prompts=[base[:k] for k in (2, 3, 4, 16, 31, 32, 48, 160, 161)])
    assert _compiled_variants(kernel) == before


def test_deferred_context_under_graphs_matches_storing_it(models):
    """Plain rounds under auto defer the drafter's context to the tap cache (captured), and a
    speculative round projects it first (eager, on the stream, between graph replays). Checked
    every few steps of scripted switches with overlapped rounds: the drafter's K/V of every
    position below where the deferral starts equals an engine's that stores it every round.
    Graphs are captured up front as the server does (catch-ups first): a catch-up captured in
    the rounds' memory pool overwrote a round's outputs before the next round read them."""
    script = [("ar", 0)] * 3 + [("ddtree", 32), ("ar", 0), ("dflash", 0)] + [("ar", 0)] * 2 + [
        ("ddtree", 8), ("ddtree", 32), ("ar", 0), ("ddtree", 32)]
    engines = []
    for defer in (True, False):
        llm = LLM(target=models[0], drafter=models[1], method="ddtree", budget="auto", device="cuda",
                  dtype=torch.float32, max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5, max_budget=32)
        engine = llm.engine
        assert engine.runner.tap_cache is not None
        if defer:
            engine.profile_auto(batch_sizes=[4])
        else:
            engine.runner.tap_cache = None
        cycle = itertools.cycle(script)
        engine.auto.choose = lambda n, fresh=False, cycle=cycle: next(cycle)
        seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for p, n in zip(_prompts(4), (150, 90, 200, 120))]
        engines.append((engine, seqs))
    compared = 0
    for step in range(120):
        for engine, _ in engines:
            engine.step()
        if step % 7:
            continue
        torch.cuda.synchronize()
        for (deferred, a), (stored, b) in zip(*[[(e, s) for s in seqs] for e, seqs in engines]):
            if a.is_finished or b.is_finished:
                continue
            upto = min(a.num_cached if a.context_from is None else a.context_from, b.num_cached)
            torch.testing.assert_close(_drafter_context(deferred, a, upto), _drafter_context(stored, b, upto),
                                       atol=1e-4, rtol=1e-4)
            compared += upto
    assert compared > 1000 and engines[0][0].runner.caught_up_tokens > 100
    assert engines[0][0].overlapped_rounds > 50


def _drafter_context(engine, seq, upto):
    bs = engine.blocks.block_size
    pos = torch.arange(upto)
    slots = torch.tensor(seq.block_table)[pos // bs] * bs + pos % bs
    return engine.runner.drafter_kv[:, :, slots.cuda()]


def test_fused_context_store_matches_torch_path(models, monkeypatch):
    """The drafter's context update on CUDA (one K/V GEMM for all layers + Triton rope/store)
    writes what the per-layer torch path writes."""
    _, drafter = models
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = 37
    taps = torch.randn(T, drafter.fc.in_features, device="cuda", generator=gen)
    positions = torch.arange(100, 100 + T, device="cuda")
    slots = torch.randperm(256, device="cuda", generator=gen)[:T]
    layers, heads, dim = drafter.kv_shape()
    caches = [torch.zeros(layers, 2, 256, heads, dim, device="cuda") for _ in range(2)]
    with torch.inference_mode():
        drafter.store_context(taps, positions, caches[0], slots)
        monkeypatch.setenv("DDTREE_TRITON", "0")
        drafter.store_context(taps, positions, caches[1], slots)
    assert caches[0].abs().sum() > 0
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)


def test_drafter_training_on_cuda_matches_cpu_and_learns(models, tmp_path):
    """Training takes the torch path under autograd (the Triton kernels have no backward) while the
    frozen target's taps still run on the kernels; the first loss equals the CPU's (bf16 autocast
    on CUDA) and training learns the counting pattern."""
    import copy
    import json

    from test_train import write_sequences
    from ddtree.train.trainer import TrainConfig, train_drafter
    target = models[0]
    write_sequences(tmp_path / "responses.pt")
    cfg = TrainConfig(num_layers=1, num_taps=2, block_size=4, steps=100, batch_size=8, anchors=8, max_len=64,
                      lr=1e-2)
    train_drafter(copy.deepcopy(target).cpu(), tmp_path / "responses.pt", tmp_path / "cpu",
                  TrainConfig(**{**cfg.__dict__, "steps": 1}), log_every=1)
    train_drafter(target, tmp_path / "responses.pt", tmp_path / "cuda", cfg, log_every=1)
    cpu = [json.loads(line) for line in (tmp_path / "cpu" / "train_log.jsonl").read_text().splitlines()]
    cuda = [json.loads(line) for line in (tmp_path / "cuda" / "train_log.jsonl").read_text().splitlines()]
    assert cuda[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=0.02)
    assert cuda[-1]["loss"] < 0.7 * cuda[0]["loss"]


def test_fresh_round_behind_an_unfinished_prefill_is_timed_from_its_end(models):
    """Graph prefills launch without a host sync; a round launched while one still runs carries
    the prefill's end event, so auto's cost sample excludes the prefill's remaining GPU time."""
    import time
    target, drafter = models
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=32, device="cuda", dtype=torch.float32,
              max_model_len=1024, max_num_seqs=4, kv_cache_gb=0.5, max_budget=32)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = _prompts(2, seed=3)[1]
    llm.generate([prompt], params)  # captures this prefill's and round's graphs (a capture syncs)
    seq = engine.add_request(prompt, params, method="ddtree", budget=32)
    kind, seqs, chunks = engine.scheduler.schedule()
    assert kind == "prefill"
    torch.cuda._sleep(200_000_000)  # the GPU is still busy when the round is launched
    runner.prefill(seqs, chunks)
    started = time.perf_counter()
    launched = runner.launch([seq], "ddtree", 32)
    assert launched.behind_prefill is not None
    runner.finish(launched)
    wall = time.perf_counter() - started
    gpu = launched.seconds_behind_prefill()
    assert 0 < gpu < wall / 5  # the wait for the sleep and the prefill is not the round's cost
    engine.abort(seq.request_id)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_fused_sampler_in_captured_rounds_is_lossless(method, monkeypatch):
    """On CUDA, unfiltered sampling runs in the LM head's epilogue inside the captured rounds:
    3-token continuations of a tiny model under AR, the chain and DDTree match the exact
    distribution (chi-square at 0.001, as tests/test_sampling_lossless.py does on CPU)."""
    import copy
    from ddtree.kernels import triton_lm_head
    from ddtree.models.dflash import random_drafter
    from test_sampling_lossless import ALPHA, PROMPT, exact_distribution, goodness_of_fit
    from tiny import tiny_model
    model = tiny_model("llama", vocab=6, layers=2, std=0.35, heads=2, kv_heads=1, head_dim=16)
    params = dict(temperature=0.8, top_k=0, top_p=1.0, max_tokens=3, ignore_eos=True)
    exact = exact_distribution(model, params)
    torch.manual_seed(0)
    drafter = random_drafter(model.config, num_layers=1, block_size=4, num_taps=1, seed=0)
    llm = LLM(target=copy.deepcopy(model), drafter=drafter if method != "ar" else None, method=method,
              budget=10, device="cuda", dtype=torch.float32, max_model_len=16, max_num_seqs=64, kv_cache_gb=0.05)
    calls = []
    real = triton_lm_head.lm_head_sample_triton
    monkeypatch.setattr(triton_lm_head, "lm_head_sample_triton", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    outs = llm.generate([PROMPT] * 4000, SamplingParams(**params))
    assert calls  # the Triton sampler was captured (graphs replay it without calling Python)
    assert goodness_of_fit([tuple(o.token_ids) for o in outs], exact) > ALPHA
    if method != "ar":
        lens = [n for o in outs for n in o.metrics.accepted_lengths]
        # drafts were accepted, so the walk used the samples (a 3-token chain accepts less: ~1.23 on CPU)
        assert sum(lens) / len(lens) > (1.3 if method == "ddtree" else 1.15)


def test_logprobs_beside_graph_rounds(models):
    """Requests with logprobs run eager rounds (the graphs sample in the LM head) in a batch that
    otherwise replays graphs: every token stays the graph run's, and the logprobs are the
    target's own (a teacher-forced pass)."""
    from test_logprobs import teacher_forced
    prompts = _prompts(4)
    plain, _ = _run(models, "ddtree", 32, graphs=True, overlap=True, prompts=prompts, batched=True)
    llm = LLM(target=models[0], drafter=models[1], method="ddtree", budget=32, device="cuda", dtype=torch.float32,
              max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5, max_budget=32)
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i in range(4)]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    for i in (1, 3):
        ref = teacher_forced(models[0], prompts[i], outs[i].token_ids)
        got = torch.tensor([lp for lp, _ in outs[i].logprobs], dtype=torch.float64)
        assert torch.allclose(got, ref.gather(1, torch.tensor(outs[i].token_ids)[:, None])[:, 0], atol=1e-3)
        assert [[t for t, _ in best] for _, best in outs[i].logprobs] == ref.topk(2).indices.tolist()
    assert outs[0].logprobs is None


def test_processed_requests_beside_graph_rounds(models):
    """Penalties and logit_bias on the GPU: eager rounds for those requests in a batch that
    otherwise replays graphs; their greedy tokens are a float64 reference's on full target
    passes, the others' are the graph run's."""
    from test_processing import reference_greedy
    prompts = _prompts(4)
    plain, _ = _run(models, "ddtree", 32, graphs=True, overlap=True, prompts=prompts, batched=True)
    llm = LLM(target=models[0], drafter=models[1], method="ddtree", budget=32, device="cuda", dtype=torch.float32,
              max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5, max_budget=32)
    processed = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.8,
                               frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={7: 3.0})
    params = [processed if i % 2 else SamplingParams(temperature=0, max_tokens=64, ignore_eos=True) for i in range(4)]
    outs = llm.generate(prompts, params)
    for i in (0, 2):
        assert outs[i].token_ids == plain[i]
    for i in (1, 3):
        assert outs[i].token_ids == reference_greedy(models[0], prompts[i], processed, set())


def test_graphs_captured_up_front_leave_nothing_to_capture_while_serving(models):
    """The server's start-up capture (``capture_graphs`` in every sampling mode) covers what
    greedy, sampled and top-p batches replay as their sequences grow through the key bounds and
    the batch drains: generating afterwards captures no graph (a capture would stall every
    stream in flight)."""
    target, drafter = models
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=16, device="cuda", dtype=torch.float32,
              max_model_len=1024, max_num_seqs=4, kv_cache_gb=0.5, max_budget=32)
    llm.engine.capture_graphs([("ddtree", 16, False)], ("greedy", "sample", "filtered"))
    captured = llm.engine.runner.num_captured
    prompts = _prompts(4)  # 5-64 tokens, then up to 700 more: past the 512-key bound
    lengths = [700, 300, 120, 40]
    for extra in ({"temperature": 0}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}):
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **extra) for n in lengths]
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == lengths
    assert llm.engine.runner.num_captured == captured
