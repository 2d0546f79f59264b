"""Logprobs (SamplingParams.logprobs): every output token's log-probability and the most likely
tokens must be the target's own for that prefix, whatever the method and however many tokens a
round accepts; checked against one teacher-forced pass of the target over prompt + output."""
import pytest
import torch

from ddtree import SamplingParams
from ddtree.context import AttentionContext
from ddtree.engine.llm import SHIPPED_DRAFTERS

from conftest import make_llm

SHIPPED = SHIPPED_DRAFTERS / "SmolLM2-135M-Instruct-DFlash"
TOP = 3


def teacher_forced(smol, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits that predicted each output token: [len(output), V]."""
    return torch.log_softmax(forward_logits(smol, prompt, output).double(), -1)


def forward_logits(smol, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's raw logits (one full pass) that predicted each output token, on the CPU."""
    ids = prompt + output
    n = len(ids)
    layers, heads, dim = smol.kv_shape()
    dev = smol.lm_head.weight.device
    kv = [(torch.zeros(n, heads, dim, device=dev), torch.zeros(n, heads, dim, device=dev)) for _ in range(layers)]
    with torch.no_grad():
        hidden, _ = smol(torch.tensor(ids, device=dev), torch.arange(n, device=dev), kv,
                         AttentionContext.contiguous([n], device=dev))
        logits = smol.logits(hidden)
    return logits[len(prompt) - 1:n - 1].cpu()


def check_against_reference(smol, prompt, out, top=TOP):
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = teacher_forced(smol, prompt, out.token_ids)
    for j, (token, (lp, best)) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp == pytest.approx(float(ref[j, token]), abs=2e-4), (j, token)
        ref_lp, ref_ids = ref[j].topk(top)
        assert [t for t, _ in best] == ref_ids.tolist(), j
        assert [x for _, x in best] == pytest.approx(ref_lp.tolist(), abs=2e-4), j


@pytest.fixture(scope="module")
def tree_llm(smol, tokenizer):
    return make_llm(smol, tokenizer, method="ddtree", budget=16, drafter=SHIPPED)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP),
    # raw logprobs: neither the temperature nor top-p changes them
    SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=TOP),
    SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=TOP),
], ids=["greedy", "seeded-top-p", "sampled"])
def test_tree_logprobs_are_the_targets(smol, tree_llm, prompts, params):
    outs = tree_llm.generate(prompts[:3], params)
    for p, o in zip(prompts[:3], outs):
        check_against_reference(smol, p, o)
    # rounds accepted several tokens, so path order and the bonus token's place were exercised
    assert max(n for o in outs for n in o.metrics.accepted_lengths) >= 3


def test_logprobs_beside_requests_without_them_and_after_a_stop(smol, tokenizer, tree_llm, prompts):
    ar = make_llm(smol, tokenizer, method="ar").generate(prompts[:2], SamplingParams(temperature=0, max_tokens=24))
    stop = tokenizer.decode(ar[0].token_ids[5:7])  # completed mid-round: later tokens are dropped
    outs = tree_llm.generate(prompts[:2], [
        SamplingParams(temperature=0, max_tokens=24, logprobs=0, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=24)])
    assert outs[1].logprobs is None and outs[1].token_ids == ar[1].token_ids
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 24
    assert outs[0].token_ids == ar[0].token_ids[:len(outs[0].token_ids)]
    check_against_reference(smol, prompts[0], outs[0], top=0)
    assert all(best == [] for _, best in outs[0].logprobs)


@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0)])
def test_plain_and_chain_logprobs_are_the_targets(smol, tokenizer, prompts, method, budget):
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED)
    out = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP))[0]
    check_against_reference(smol, prompts[3], out)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_logprobs_rejected(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_prompt_logprobs_are_the_targets(smol, tokenizer, prompts):
    """Prompt tokens' logprobs (from the prefill, here in chunks of 16 tokens beside other
    prompts) are the target's own; the first prompt token has none."""
    llm = make_llm(smol, tokenizer, method="ddtree", budget=8, drafter=SHIPPED, max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), SamplingParams(temperature=0, max_tokens=2)]
    outs = llm.generate([prompts[1], prompts[2]], params)
    assert outs[1].prompt_logprobs is None
    p = prompts[1]
    got = outs[0].prompt_logprobs
    assert len(got) == len(p) - 1 and len(p) > 16
    ref = teacher_forced(smol, p[:1], p[1:])
    for j, (lp, best) in enumerate(got):
        assert lp == pytest.approx(float(ref[j, p[j + 1]]), abs=2e-4), j
        assert [t for t, _ in best] == ref[j].topk(2).indices.tolist(), j
