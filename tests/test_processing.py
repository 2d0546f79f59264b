"""Logits processing (penalties, logit_bias, min_tokens, min_p, allowed_token_ids, bad_words) stays lossless: every node of a tree
gets the logits plain decoding would have after that node's prefix. Checked per node against a
naive loop, and end to end against a greedy reference written here (full target passes, the
processing in float64), for plain decoding, the chain and trees."""
from collections import Counter

import pytest
import torch

from ddtree import SamplingParams
from ddtree.engine.llm import SHIPPED_DRAFTERS
from ddtree.tree import Processing, ancestor_mask, process_tree_logits

from conftest import make_llm
from test_logprobs import forward_logits

SHIPPED = SHIPPED_DRAFTERS / "SmolLM2-135M-Instruct-DFlash"


def process_naive(x: torch.Tensor, prompt, output, params: SamplingParams, stops, bad_words=()) -> torch.Tensor:
    """vLLM's order for one position after ``prompt + output``: allowed_token_ids and bad words
    (token lists, matched against the output), min_tokens, logit_bias, then the repetition,
    frequency and presence penalties, then min_p."""
    x = x.double().clone()
    if params.allowed_token_ids is not None:
        x[[t for t in range(len(x)) if t not in params.allowed_token_ids]] = float("-inf")
    for word in bad_words:
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]:
            x[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        x[list(stops)] = float("-inf")
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    if params.min_p and params.temperature > 0:  # as vLLM: on the probabilities after temperature
        probs = torch.softmax(x / params.temperature, -1)
        x[probs < params.min_p * probs.max()] = float("-inf")
    return x


def test_tree_nodes_get_their_own_prefix_processing():
    torch.manual_seed(0)
    N, T, V = 3, 12, 9
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                             logit_bias={2: 3.0, 5: -1.5}, min_tokens=4, max_tokens=32, min_p=0.05,
                             temperature=0.7, allowed_token_ids=[0, 1, 2, 3, 5, 7, 8]),
              SamplingParams(),  # a request without processing in the same round: untouched
              SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.5, min_tokens=1, max_tokens=32)]
    prompts = [[1, 2, 3], [4, 4], [0, 8]]
    outputs = [[3, 3, 7], [], [8, 1, 1, 6, 2]]
    stops = [0, 6]
    bad_words = [[[3, 7], [7, 2], [4], [3, 3, 7, 1]], [], [[1, 6], [2, 2], [6, 2, 2]]]
    parents = torch.stack([torch.tensor([0] + [int(torch.randint(0, i, ())) for i in range(1, T)]) for _ in range(N)])
    depths = torch.zeros(N, T, dtype=torch.long)
    for i in range(1, T):
        depths[:, i] = depths.gather(1, parents[:, i:i + 1])[:, 0] + 1
    tokens = torch.randint(0, V, (N, T))  # repeats within a tree, on and off a path
    tokens[:, 0] = torch.tensor([o[-1] if o else p[-1] for p, o in zip(prompts, outputs)])
    logits = torch.randn(N, T, V) * 3
    proc = Processing.build(outputs, prompts, [p.logit_bias for p in params],
                            [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                            [p.presence_penalty for p in params],
                            [max(0, p.min_tokens - len(o)) for p, o in zip(params, outputs)],
                            [stops] * N, V, "cpu", min_p=[p.min_p for p in params],
                            temperature=[p.temperature for p in params],
                            allowed=[p.allowed_token_ids for p in params], bad_words=bad_words)
    got = process_tree_logits(logits, tokens, depths, ancestor_mask(parents, int(depths.max())), proc)
    banned_below_root = 0
    for n in range(N):
        for i in range(T):
            path, j = [], i
            while j != 0:
                path.append(int(tokens[n, j]))
                j = int(parents[n, j])
            want = process_naive(logits[n, i], prompts[n], outputs[n] + path[::-1], params[n], stops, bad_words[n])
            if i and path:
                no_words = process_naive(logits[n, i], prompts[n], outputs[n] + path[::-1], params[n], stops)
                banned_below_root += int((want.isinf() & ~no_words.isinf()).sum())
            assert torch.equal(got[n, i].isinf(), want.isinf()), (n, i)
            keep = ~want.isinf()
            assert torch.allclose(got[n, i].double()[keep], want[keep], atol=1e-5), (n, i)
    assert banned_below_root >= 5  # bad words matched along tree paths, not only in the committed tail
    assert torch.equal(got[1], logits[1])
    # plain decoding: the root alone
    alone = process_tree_logits(logits[:, :1], tokens[:, :1], depths[:, :1], None, proc)
    assert torch.allclose(alone, got[:, :1])


PROCESSED = SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.3, logit_bias={504: 4.0, 28: -100.0}, min_tokens=6)


def reference_greedy(smol, prompt, params, stops, bad_words=()) -> list[int]:
    out = []
    while len(out) < params.max_tokens:
        x = process_naive(forward_logits(smol, prompt, out + [0])[-1], prompt, out, params, stops, bad_words)
        out.append(int(x.argmax()))
        if len(out) > params.min_tokens and out[-1] in stops:
            break
    return out


@pytest.fixture(scope="module")
def references(smol, tokenizer, prompts):
    return [reference_greedy(smol, p, PROCESSED, {tokenizer.eos_token_id}) for p in (prompts[0], prompts[16])]


@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 16)])
def test_processed_greedy_equals_reference(smol, tokenizer, prompts, references, method, budget):
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED)
    plain = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate([prompts[0], prompts[16], prompts[0]], [PROCESSED, PROCESSED, plain])
    assert [o.token_ids for o in outs[:2]] == references
    assert outs[2].token_ids != references[0]  # the processing changed the output ...
    ar = make_llm(smol, tokenizer, method="ar").generate(prompts[0], plain)[0]
    assert outs[2].token_ids == ar.token_ids  # ... of its own request only
    if method == "ddtree":
        assert max(n for o in outs[:2] for n in o.metrics.accepted_lengths) >= 3


@pytest.fixture(scope="module")
def masked(smol, tokenizer, prompts):
    """A request whose greedy output both masks change: one bad word taken from the plain output's
    text, and allowed_token_ids = the plain output's tokens and EOS; with its reference."""
    eos = tokenizer.eos_token_id
    plain = reference_greedy(smol, prompts[0], SamplingParams(temperature=0, max_tokens=20), {eos})
    word = tokenizer.decode(plain[5:7]).strip()
    params = SamplingParams(temperature=0, max_tokens=20, bad_words=[word], allowed_token_ids=sorted(set(plain) | {eos}))
    words = make_llm(smol, tokenizer, method="ar").engine.bad_words_token_ids([word])
    want = reference_greedy(smol, prompts[0], params, {eos}, words)
    assert want != plain and set(want) <= set(params.allowed_token_ids)
    return params, want


@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 16)])
def test_bad_words_and_allowed_token_ids_equal_reference(smol, tokenizer, prompts, masked, method, budget):
    params, want = masked
    llm = make_llm(smol, tokenizer, method=method, budget=budget, drafter=SHIPPED)
    out = llm.generate([prompts[0]], [params])[0]
    assert out.token_ids == want
    assert params.bad_words[0] not in out.text


def test_min_tokens_holds_back_eos_and_stop_strings(smol, tokenizer, prompts):
    llm = make_llm(smol, tokenizer, method="ddtree", budget=16, drafter=SHIPPED)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    short = llm.generate(prompts[16], greedy)[0]  # "hi": a short answer, then EOS
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = llm.generate(prompts[16], SamplingParams(temperature=0, max_tokens=40, min_tokens=20))[0]
    assert len(longer.token_ids) >= 20 and tokenizer.eos_token_id not in longer.token_ids[:20]
    stop = tokenizer.decode(short.token_ids[1:3])
    early = llm.generate(prompts[16], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    late = llm.generate(prompts[16], SamplingParams(temperature=0, max_tokens=40, stop=[stop], min_tokens=3))[0]
    assert len(early.token_ids) <= 3 and stop not in early.text
    assert len(late.token_ids) > 3 and stop in late.text[:len(tokenizer.decode(late.token_ids[:3]))]


@pytest.mark.parametrize("kw,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101}), "logit_bias"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(min_p=1.5), "min_p"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"), (dict(bad_words=["w"] * 129), "bad_words")])
def test_bad_processing_rejected(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_rejected(smol, tokenizer):
    llm = make_llm(smol, tokenizer, method="ar")
    with pytest.raises(ValueError, match="logit_bias token id 49152"):
        llm.generate("hi", SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids token id 49152"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[1, 49152]))
