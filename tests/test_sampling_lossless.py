"""Sampling losslessness on a tiny random model (vocab 6): the distribution of 3-token
continuations under DDTree (and the DFlash chain) matches AR sampling and the exact distribution,
by chi-square tests at significance 0.001; a deliberately wrong acceptance rule fails them."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from ddtree import LLM, SamplingParams
from ddtree.context import AttentionContext
from ddtree.engine import runner as runner_mod
from ddtree.models.dflash import random_drafter
from ddtree.tree import accept_walk, filtered_probs, gather_rows, sample_from_logits
from tiny import tiny_model

ALPHA = 0.001
N_SAMPLES = 4000
PROMPT = [1, 2, 3]
PARAMS = dict(temperature=0.8, top_k=5, top_p=0.95, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab=6, layers=2, std=0.35)


def exact_distribution(model, params) -> dict[tuple, float]:
    """P(continuation) by enumerating every 3-token continuation with full forwards."""
    t = torch.tensor
    probs = {}
    for cont in itertools.product(range(model.config.vocab_size), repeat=3):
        ids = PROMPT + list(cont)
        n = len(ids)
        c = model.config
        kv = [(torch.zeros(n, c.num_key_value_heads, c.head_dim), torch.zeros(n, c.num_key_value_heads, c.head_dim))
              for _ in range(c.num_hidden_layers)]
        ctx = AttentionContext.contiguous([n])
        with torch.no_grad():
            hidden, _ = model(t(ids), torch.arange(n), kv, ctx)
            logits = model.logits(hidden)[None]
        dist = filtered_probs(logits, t([params["temperature"]]), t([params["top_k"]]), t([params["top_p"]]))[0]
        p = 1.0
        for j, tok in enumerate(cont):
            p *= float(dist[len(PROMPT) - 1 + j, tok])
        probs[cont] = p
    return probs


def sample(model, method, seed=0, budget=10):
    torch.manual_seed(seed)
    drafter = random_drafter(model.config, num_layers=1, block_size=4, num_taps=1, seed=seed)
    llm = LLM(target=model, drafter=drafter if method != "ar" else None, method=method, budget=budget,
              device="cpu", max_model_len=16, max_num_seqs=N_SAMPLES, kv_cache_gb=0.05)
    outs = llm.generate([PROMPT] * N_SAMPLES, SamplingParams(**PARAMS))
    return [tuple(o.token_ids) for o in outs], llm


def counts(samples, support):
    index = {c: i for i, c in enumerate(support)}
    out = np.zeros(len(support))
    for s in samples:
        out[index[s]] += 1
    return out


def goodness_of_fit(samples, exact) -> float:
    """Chi-square p-value of the samples against the exact law; 0 if any sample is impossible."""
    support = [c for c, p in exact.items() if p > 0]
    if not set(samples) <= set(support):
        return 0.0
    expected = np.array([exact[c] for c in support]) * len(samples)
    observed = counts(samples, support)
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs, exp = observed[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def two_sample(a, b) -> float:
    support = sorted(set(a) | set(b))
    table = np.stack([counts(a, support), counts(b, support)])
    keep = table.sum(0) >= 10
    table = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], 1)
    return chi2_contingency(table).pvalue


@pytest.fixture(scope="module")
def reference(tiny):
    exact = exact_distribution(tiny, PARAMS)
    assert abs(sum(exact.values()) - 1) < 1e-4
    ar_samples, _ = sample(tiny, "ar", seed=1)
    assert goodness_of_fit(ar_samples, exact) > ALPHA
    return exact, ar_samples


# budget 2: a tree that drafts 2 of the block's 3 depths (ModelRunner.draft_depth)
@pytest.mark.parametrize("method,budget", [("ddtree", 10), ("ddtree", 2), ("dflash", 0)])
def test_speculative_sampling_matches_ar(tiny, reference, method, budget):
    exact, ar_samples = reference
    samples, llm = sample(tiny, method, seed=2, budget=budget)
    steps = [n for o in llm.engine.seqs.values() for n in o.metrics.accepted_lengths]
    assert not steps  # finished requests leave the engine
    assert goodness_of_fit(samples, exact) > ALPHA
    assert two_sample(samples, ar_samples) > ALPHA


def test_speculation_accepted_drafts(tiny):
    """The test above is only meaningful if drafts are actually accepted."""
    torch.manual_seed(3)
    drafter = random_drafter(tiny.config, num_layers=1, block_size=4, num_taps=1, seed=3)
    llm = LLM(target=tiny, drafter=drafter, method="ddtree", budget=10, device="cpu", max_model_len=16,
              max_num_seqs=500, kv_cache_gb=0.05)
    outs = llm.generate([PROMPT] * 500, SamplingParams(**PARAMS))
    lens = [n for o in outs for n in o.metrics.accepted_lengths]
    assert sum(lens) / len(lens) > 1.3
    assert max(lens) == 3  # whole continuations accepted in one step


def test_wrong_acceptance_rule_is_detected(tiny, reference, monkeypatch):
    """Walk the tree with the target's argmax instead of its samples (a classic bug): the same
    tests must reject it."""
    exact, ar_samples = reference

    def argmax_walk(self, kind, inp, tree, verified, generators):
        logits = verified.logits  # (the CPU path: no fused sampling)
        samples = sample_from_logits(logits, inp.temperature, inp.top_k, inp.top_p, generators)
        path, num, _ = accept_walk(tree.tokens, tree.parents, tree.depths, logits.argmax(-1), tree.max_depth)
        bonus = gather_rows(samples, path)[torch.arange(path.shape[0]), num - 1]
        return path, num, bonus

    monkeypatch.setattr(runner_mod.ModelRunner, "accept", argmax_walk)
    samples, _ = sample(tiny, "ddtree", seed=2)
    assert goodness_of_fit(samples, exact) < ALPHA
    assert two_sample(samples, ar_samples) < ALPHA


PROCESSED = dict(PARAMS, presence_penalty=0.6, frequency_penalty=0.5, repetition_penalty=1.5,
                 logit_bias={0: 1.0, 4: -0.7}, min_p=0.2)


def test_processed_sampling_matches_exact(tiny):
    """Penalties, logit_bias and min_p: DDTree (and AR) samples follow the exact law of sampling each
    token from the processed, filtered logits of its own prefix (processing written in the test,
    not the engine's)."""
    from test_processing import process_naive
    params = SamplingParams(**PROCESSED)
    exact = {}
    for cont in itertools.product(range(tiny.config.vocab_size), repeat=3):
        ids = PROMPT + list(cont)
        n, c = len(ids), tiny.config
        kv = [(torch.zeros(n, c.num_key_value_heads, c.head_dim), torch.zeros(n, c.num_key_value_heads, c.head_dim))
              for _ in range(c.num_hidden_layers)]
        with torch.no_grad():
            logits = tiny.logits(tiny(torch.tensor(ids), torch.arange(n), kv, AttentionContext.contiguous([n]))[0])
        p = 1.0
        for j, tok in enumerate(cont):
            x = process_naive(logits[len(PROMPT) - 1 + j], PROMPT, list(cont[:j]), params, set()).float()
            dist = filtered_probs(x[None, None], torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                                  torch.tensor([params.top_p]))[0, 0]
            p *= float(dist[tok])
        exact[cont] = p
    assert abs(sum(exact.values()) - 1) < 1e-4
    plain = exact_distribution(tiny, PARAMS)
    assert sum(abs(exact[k] - plain[k]) for k in exact) > 0.2  # the processing matters here
    for method, seed in (("ar", 4), ("ddtree", 7)):  # a drafter seed whose trees accept full paths
        torch.manual_seed(seed)
        drafter = random_drafter(tiny.config, num_layers=1, block_size=4, num_taps=1, seed=seed)
        llm = LLM(target=tiny, drafter=drafter if method != "ar" else None, method=method, budget=10,
                  device="cpu", max_model_len=16, max_num_seqs=N_SAMPLES, kv_cache_gb=0.05)
        outs = llm.generate([PROMPT] * N_SAMPLES, params)
        assert goodness_of_fit([tuple(o.token_ids) for o in outs], exact) > ALPHA, method
        if method == "ddtree":
            assert max(n for o in outs for n in o.metrics.accepted_lengths) == 3
