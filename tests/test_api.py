"""The LLM API: bad input gets a clear ValueError naming the field, a bad request does not
disturb the others, stop rules, seeds, chat template, CLI."""
import subprocess
import sys

import pytest
import torch

from ddtree import LLM, SamplingParams

from conftest import GREEDY_64, make_llm


@pytest.fixture(scope="module")
def llm(smol, tokenizer):
    return make_llm(smol, tokenizer, method="ddtree", budget=8, max_model_len=128)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(seed="x"), "seed"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.engine.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="longer than the context"):
        llm.generate([5] * 200, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 10**7]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "hi"}], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kwargs,field", [
    (dict(budget=-1), "budget"),
    (dict(method="beam"), "method"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(kv_cache_gb=0), "kv_cache_gb"),
    (dict(dtype="float8"), "dtype"),
])
def test_bad_engine_settings(smol, tokenizer, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_llm(smol, tokenizer, **{**dict(method="ddtree", budget=8), **kwargs})


def test_bad_per_request_settings(llm, prompts):
    with pytest.raises(ValueError, match="budget"):
        llm.engine.add_request(prompts[0], GREEDY_64, budget=1000)
    with pytest.raises(ValueError, match="method"):
        llm.engine.add_request(prompts[0], GREEDY_64, method="medusa")


def test_bad_request_does_not_disturb_others(llm, prompts, ar_reference):
    engine = llm.engine
    good = [engine.add_request(p, GREEDY_64) for p in prompts[:3]]
    engine.step()
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=0))
    with pytest.raises(ValueError, match="longer than the context"):
        engine.add_request([1] * 500, GREEDY_64)
    while engine.has_unfinished():
        engine.step()
    for p, s in zip(prompts[:3], good):
        assert engine.output(s).token_ids == ar_reference[tuple(p)]
    # generate() with one bad prompt in a batch raises and leaves nothing queued behind.
    with pytest.raises(ValueError):
        llm.generate([prompts[0], []], GREEDY_64)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_max_tokens_and_eos(llm, prompts, ar_reference):
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == ar_reference[tuple(prompts[0])][:5] and out.finish_reason == "length"
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    assert out.text == "The capital of France is Paris."


def test_stop_strings_and_token_ids(llm, prompts, ar_reference):
    ref = ar_reference[tuple(prompts[0])]
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=64, stop=" is"))[0]
    assert out.text == "The capital of France" and out.finish_reason == "stop"
    assert ref[:len(out.token_ids)] == out.token_ids
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[ref[3]]))[0]
    assert out.token_ids == ref[:4] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(llm, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    a = llm.generate(prompts[5], params)[0].token_ids
    b = llm.generate(prompts[5], params)[0].token_ids
    c = llm.generate(prompts[5], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99))[0].token_ids
    assert a == b and a != c


def test_chat_and_metrics(llm):
    outs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "hi"}]], SamplingParams(temperature=0, max_tokens=16))
    assert outs[0].text.startswith("The capital of France is Paris")
    for o in outs:
        assert o.metrics.num_verify_steps == len(o.metrics.accepted_lengths) > 0
        assert sum(o.metrics.accepted_lengths) == len(o.token_ids)


def test_cli_generate(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", "What is the capital of France?",
                           "--method", "ddtree", "--budget", "8", "--max-tokens", "12", "--device", "cpu",
                           "--drafter", "random"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tau=" in proc.stderr and "tok/s" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", "x", "--budget", "-2",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "budget" in proc.stderr
