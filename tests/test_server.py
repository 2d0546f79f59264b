"""The OpenAI-compatible server, started for real on loopback once for this module (uvicorn in a
thread), spoken to with the official ``openai`` client and raw httpx; plus one subprocess server
for SIGTERM. SmolLM2 + random drafter, budget 8, small max_tokens (CPU)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from conftest import make_llm
from test_logprobs import teacher_forced
from ddtree import SamplingParams
from ddtree.server.app import ENGINE_ERROR_STATUS, build_app
from ddtree.server.serving import bind_socket, make_server

MODEL = "smol-test"
MAX_LEN = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is 17 times 23?"}]
N_TOKENS = 12


def _wait_idle(engine, timeout=10.0) -> bool:
    """True once the engine has no request and every KV block is free."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server(smol, tokenizer):
    # Two OpenMP threads on a 2-core machine shared with other jobs can run 10x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = make_llm(smol, tokenizer, method="ddtree", budget=8, max_model_len=MAX_LEN, kv_cache_gb=0.1)
    greedy = SamplingParams(temperature=0, max_tokens=N_TOKENS)
    # References from the offline API on the same LLM, before the engine thread owns it.
    ref = {p: o for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy))}
    ref_chat = llm.chat(CHAT, greedy)[0]
    app = build_app(llm, served_model_name=MODEL, shutdown_grace_s=2.0)
    sock = bind_socket("127.0.0.1", 0)
    srv = make_server(app, log_level="warning", grace_s=2.0)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not srv.started and thread.is_alive() and time.monotonic() < end:
        time.sleep(0.05)
    assert srv.started, "server did not start"
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    yield SimpleNamespace(url=url, app=app, llm=llm, engine=llm.engine, aengine=app.state.server.engine,
                          ref=ref, ref_chat=ref_chat, client=client, tokenizer=tokenizer)
    srv.should_exit = True
    thread.join(20)
    sock.close()
    assert not thread.is_alive(), "server thread did not stop"
    assert not app.state.server.engine.alive, "engine thread did not stop"
    torch.set_num_threads(threads)


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# ---- happy paths ---------------------------------------------------------------------------------
def test_models_health_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ddtree:num_requests_running", "ddtree:num_requests_waiting", "ddtree:kv_cache_usage_perc",
                 "ddtree:time_to_first_token_seconds_bucket", "ddtree:inter_token_latency_seconds_bucket",
                 "ddtree:spec_decode_num_drafts_total", "ddtree:spec_decode_num_draft_tokens_total",
                 "ddtree:spec_decode_num_accepted_tokens_total", "ddtree:spec_decode_mean_acceptance_length",
                 'ddtree:spec_decode_budget{method="ddtree"'):
        assert name in text, name


def test_completions_greedy_equals_generate(server):
    c = server.client
    for prompt in PROMPTS:
        ref = server.ref[prompt]
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        n_prompt = len(server.tokenizer.encode(prompt, add_special_tokens=False))
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
            (n_prompt, len(ref.token_ids), n_prompt + len(ref.token_ids))
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_greedy_equals_chat(server):
    c, ref = server.client, server.ref_chat
    out = c.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=N_TOKENS, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    # Without include_usage: no usage chunk; the SSE stream ends with data: [DONE].
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    body = [json.loads(d) for d in data[:-1]]
    assert all("usage" not in b and b["object"] == "chat.completion.chunk" for b in body)
    assert body[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices(server):
    """n choices per prompt, numbered prompt * n + i; usage counts each prompt once. Greedy choices
    equal plain decoding; seeded sampled ones are reproducible, choice 0 is what n=1 with that seed
    draws, and the others draw from other seeds."""
    c = server.client
    out = c.completions.create(model=MODEL, prompt=list(PROMPTS), max_tokens=N_TOKENS, temperature=0, n=2)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in out.choices] == [server.ref[p].text for p in PROMPTS for _ in range(2)]
    n_prompt = sum(len(server.tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS)
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 2 * sum(len(server.ref[p].token_ids) for p in PROMPTS)

    def chat(**kw):
        return c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N_TOKENS, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True}, **kw)
    three = chat(n=3)
    texts = [ch.message.content for ch in three.choices]
    assert [ch.index for ch in three.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert three.usage.prompt_tokens == len(server.ref_chat.prompt_token_ids)
    assert three.usage.completion_tokens == 3 * N_TOKENS
    assert [ch.message.content for ch in chat(n=3).choices] == texts
    assert chat(n=1).choices[0].message.content == texts[0]
    streamed = ["", "", ""]
    finished = set()
    for chunk in chat(n=3, stream=True):
        assert len(chunk.choices) == 1
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
        if chunk.choices[0].finish_reason:
            finished.add(chunk.choices[0].index)
    assert streamed == texts and finished == {0, 1, 2}


def test_logprobs(server, smol):
    """Completions' and chat's logprobs objects hold the target's own logprobs (one teacher-forced
    pass), streamed or not."""
    c, prompt = server.client, PROMPTS[0]
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0, logprobs=2)
    ch, ref = out.choices[0], server.ref[prompt]
    assert ch.text == ref.text
    lp = ch.logprobs
    assert "".join(lp.tokens) == ch.text and len(lp.tokens) == len(ref.token_ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    forced = teacher_forced(smol, server.tokenizer.encode(prompt, add_special_tokens=False), ref.token_ids)
    assert lp.token_logprobs == pytest.approx(forced.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0].tolist(),
                                              abs=2e-4)
    for top, chosen, x in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert len(top) <= 3 and top[chosen] == x and max(top.values()) == x  # greedy: the most likely
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                         logprobs=2, stream=True))
    assert sum((x.choices[0].logprobs.tokens for x in streamed if x.choices[0].logprobs), []) == lp.tokens
    assert sum((x.choices[0].logprobs.text_offset for x in streamed if x.choices[0].logprobs), []) == lp.text_offset

    kw = dict(model=MODEL, messages=CHAT, max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
    chat = c.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    forced = teacher_forced(smol, server.ref_chat.prompt_token_ids, server.ref_chat.token_ids)
    for t, tok, row in zip(content, server.ref_chat.token_ids, forced):
        assert t.bytes == list(t.token.encode()) and t.logprob == pytest.approx(float(row[tok]), abs=2e-4)
        assert [b.logprob for b in t.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=2e-4)
    streamed = sum((x.choices[0].logprobs.content for x in c.chat.completions.create(stream=True, **kw)
                    if x.choices and x.choices[0].logprobs), [])
    assert [t.token for t in streamed] == [t.token for t in content]
    no_top = c.chat.completions.create(**dict(kw, top_logprobs=None, max_tokens=2)).choices[0].logprobs.content
    assert len(no_top) == 2 and all(t.top_logprobs == [] for t in no_top)
    assert c.chat.completions.create(**dict(kw, logprobs=False, top_logprobs=None)).choices[0].logprobs is None


def test_echo_with_prompt_logprobs(server, smol):
    """echo: the text starts with the prompt; with logprobs, its tokens come first (the first
    without a logprob), each the target's own; streamed the same."""
    c, prompt = server.client, PROMPTS[1]
    ids = server.tokenizer.encode(prompt, add_special_tokens=False)
    ref = server.ref[prompt]
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0, echo=True, logprobs=1)
    ch = out.choices[0]
    assert ch.text == prompt + ref.text
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + len(ref.token_ids) and "".join(lp.tokens) == ch.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    forced = teacher_forced(smol, ids[:1], ids[1:] + ref.token_ids)
    want = forced.gather(1, torch.tensor(ids[1:] + ref.token_ids)[:, None])[:, 0].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    assert lp.text_offset[len(ids)] == len(prompt) and out.usage.prompt_tokens == len(ids)
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                         echo=True, logprobs=1, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == ch.text
    assert sum((x.choices[0].logprobs.tokens for x in streamed if x.choices[0].logprobs), []) == lp.tokens
    plain = c.completions.create(model=MODEL, prompt=[ids], max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    # lm-eval's local-completions loglikelihood request: token ids, context + continuation, the
    # continuation's logprobs read from [ctxlen:-1], greedy if each is its position's maximum.
    context, continuation = ids[:3], ids[3:]
    body = {"model": MODEL, "prompt": [context + continuation, ids[:2] + continuation], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    choices = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"]
    for choice, ctx in zip(sorted(choices, key=lambda x: x["index"]), (context, ids[:2])):
        got = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        forced = teacher_forced(smol, ctx, continuation)
        assert sum(got) == pytest.approx(float(forced.gather(1, torch.tensor(continuation)[:, None]).sum()), abs=1e-3)
        greedy = all(x == max(top.values()) for x, top in zip(got, choice["logprobs"]["top_logprobs"][len(ctx):-1]))
        assert greedy == all(int(row.argmax()) == t for row, t in zip(forced, continuation))


def test_tokenizer_endpoints(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-eval's remote tokenizer calls them."""
    tok, url = server.tokenizer, server.url
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    r = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(PROMPTS[1], add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPTS[1]
    chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == server.ref_chat.prompt_token_ids
    for path, body, param in [("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [-1, 5]}, "tokens"),
                              ("/detokenize", {"tokens": "hi"}, "tokens")]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(f"{url}/tokenize", json={"model": "gpt-17", "prompt": "hi"})
    assert r.status_code == 404


def test_penalties_bias_and_min_tokens(server, smol):
    """OpenAI's presence / frequency penalties and logit_bias, vLLM's repetition_penalty and
    min_tokens: the tokens of a greedy reference that applies them to full target passes."""
    from test_processing import reference_greedy
    prompt = server.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    bias = {server.ref[PROMPTS[0]].token_ids[0]: -100.0, 13: 2.5}  # not its usual first token
    out = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0, presence_penalty=0.4,
        frequency_penalty=0.6, logit_bias={str(k): v for k, v in bias.items()},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, presence_penalty=0.4, frequency_penalty=0.6,
                            repetition_penalty=1.2, logit_bias=bias, min_tokens=4)
    want = reference_greedy(smol, prompt, params, {server.tokenizer.eos_token_id})
    assert out.choices[0].text == server.tokenizer.decode(want, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(want) and out.choices[0].text != server.ref[PROMPTS[0]].text


def test_min_p_reaches_the_sampler(server):
    """vLLM's min_p: at 1.0 only the most likely token survives, so T=1 sampling is greedy."""
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=1.0,
                                           seed=5, extra_body={"min_p": 1.0})
    assert out.choices[0].text == server.ref[PROMPTS[0]].text


def test_bad_words_and_allowed_token_ids_reach_the_sampler(server):
    ref = server.ref[PROMPTS[0]]
    word = ref.text.split()[1]
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                           extra_body={"bad_words": [word]})
    assert word not in out.choices[0].text and out.choices[0].text != ref.text
    only = ref.token_ids[0]
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=1.0,
                                           extra_body={"allowed_token_ids": [only]})
    assert out.choices[0].text == server.tokenizer.decode([only] * 4)


def test_stop_string_and_token_ids(server):
    prompt = PROMPTS[0]
    ref = server.ref[prompt]
    words = ref.text.split()
    assert len(words) >= 3, ref.text
    stop = words[2]
    want = ref.text[:ref.text.find(stop)]
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                           stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    streamed = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS,
                                                     temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    # Extension: include_stop_str_in_output (vLLM's) keeps the stop string, streamed or not.
    for stream in (False, True):
        out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                               stop=[stop], stream=stream,
                                               extra_body={"include_stop_str_in_output": True})
        text = "".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text
        assert text == want + stop
    # Extension: stop_token_ids (the third generated token), and per-request speculative settings.
    k = ref.token_ids.index(ref.token_ids[2]) + 1
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                           extra_body={"stop_token_ids": [ref.token_ids[2]],
                                                       "speculative": {"method": "ddtree", "budget": 4}})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k
    assert out.choices[0].text == server.tokenizer.decode(ref.token_ids[:k], skip_special_tokens=True)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    """vLLM's truncate_prompt_tokens: the same completion as sending the last k tokens; echo shows them."""
    ids = server.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    k = len(ids) // 2
    want = server.client.completions.create(model=MODEL, prompt=ids[-k:], max_tokens=N_TOKENS, temperature=0)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                           echo=True, extra_body={"truncate_prompt_tokens": k})
    assert out.usage.prompt_tokens == k and want.usage.prompt_tokens == k
    assert out.choices[0].text == server.tokenizer.decode(ids[-k:]) + want.choices[0].text
    assert want.choices[0].text != server.ref[PROMPTS[0]].text  # the cut changed the completion
    whole = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                             extra_body={"truncate_prompt_tokens": -1})
    assert whole.choices[0].text == server.ref[PROMPTS[0]].text  # shorter than the context: untouched


def test_token_id_prompts_and_batch(server):
    ids = [server.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    out = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=N_TOKENS, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1]
    assert [ch.text for ch in out.choices] == [server.ref[p].text for p in PROMPTS]
    assert out.usage.completion_tokens == sum(len(server.ref[p].token_ids) for p in PROMPTS)
    out = server.client.completions.create(model=MODEL, prompt=list(PROMPTS), max_tokens=N_TOKENS, temperature=0,
                                           stream=True)
    texts = ["", ""]
    for ch in out:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [server.ref[p].text for p in PROMPTS]


def test_spec_metrics_count(server):
    before = _metric(server.url, "ddtree:spec_decode_num_drafts_total")
    tokens_before = _metric(server.url, "ddtree:spec_decode_num_draft_tokens_total")
    server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    drafts = _metric(server.url, "ddtree:spec_decode_num_drafts_total") - before
    assert 1 <= drafts <= 4  # one draft per verify step; at least one token per step
    assert _metric(server.url, "ddtree:spec_decode_num_draft_tokens_total") - tokens_before == 8 * drafts
    assert _metric(server.url, "ddtree:spec_decode_mean_acceptance_length") >= 1.0
    assert _metric(server.url, "ddtree:http_requests_total", endpoint="/v1/completions", status="200") >= 1


# ---- bad input -----------------------------------------------------------------------------------
LONG = "hello " * 400  # > MAX_LEN tokens
BAD = [
    ("completions", b'{"prompt": "hi", ', None, "invalid_json"),
    ("completions", b"[1, 2]", None, None),
    ("completions", {"max_tokens": 2}, "prompt", None),
    ("chat", {"max_tokens": 2}, "messages", None),
    ("chat", {"messages": "hello"}, "messages", None),
    ("chat", {"messages": []}, "messages", None),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", None),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages", None),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature", None),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", None),
    ("completions", {"prompt": "hi", "max_tokens": 2.0}, "max_tokens", None),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream", None),
    ("completions", {"prompt": ""}, "prompt", None),
    ("completions", {"prompt": []}, "prompt", None),
    ("completions", {"prompt": [10**9]}, "prompt", None),
    ("completions", {"prompt": LONG, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    ("chat", {"messages": [{"role": "user", "content": LONG}], "stream": True}, "messages",
     "context_length_exceeded"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens", "context_length_exceeded"),
    ("chat", {"messages": CHAT, "max_completion_tokens": MAX_LEN, "stream": True}, "max_completion_tokens",
     "context_length_exceeded"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature", None),
    ("chat", {"messages": CHAT, "top_p": 0}, "top_p", None),
    ("chat", {"messages": CHAT, "top_p": 1.5}, "top_p", None),
    ("chat", {"messages": CHAT, "n": 0}, "n", None),
    ("completions", {"prompt": ["a", "b"], "n": 129}, "n", None),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", None),
    ("completions", {"prompt": "hi", "best_of": 3, "stream": True}, "best_of", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop", None),
    ("completions", b'{"prompt": "lone \\ud800 surrogate"}', "prompt", None),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", None),
    ("completions", {"prompt": "hi", "speculative": {"budget": 99}}, "speculative.budget", None),
    ("completions", {"prompt": "hi", "speculative": {"method": "beam"}}, "speculative", None),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", None),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs", None),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", None),
    ("chat", {"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty", None),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
    ("completions", {"prompt": "hi", "logit_bias": {"the": 1}}, "logit_bias", None),
    ("completions", {"prompt": "hi", "logit_bias": {"-4": 1}}, "logit_bias", None),
    ("chat", {"messages": CHAT, "logit_bias": {"5": 250}}, "logit_bias", None),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias", None),
    ("completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens", None),
    ("chat", {"messages": CHAT, "min_p": 1.5}, "min_p", None),
    ("chat", {"messages": CHAT, "guided_json": {"type": "object"}}, "guided_json", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "bad_words": [" "]}, "bad_words", None),
    ("completions", {"prompt": "hi", "bad_words": "the"}, "bad_words", None),
    ("chat", {"messages": CHAT, "allowed_token_ids": []}, "allowed_token_ids", None),
    ("completions", {"prompt": "hi", "allowed_token_ids": [5, 99999999]}, "allowed_token_ids", None),
    ("chat", {"messages": CHAT, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
    ("chat", {"messages": CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", None),
    ("chat", {"messages": CHAT, "use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
]


@pytest.mark.parametrize("endpoint,body,param,code", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_400(server, endpoint, body, param, code):
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_unknown_model_and_route(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-17", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=1)
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_openapi_fuzz_no_5xx(server):
    """Schemathesis cases (valid and invalid) for both generation endpoints: never a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(server.app.openapi())
    ops = [schema["/v1/completions"]["POST"], schema["/v1/chat/completions"]["POST"]]
    strategy = st.one_of([op.as_strategy(generation_mode=mode).map(lambda c, m=mode: (m, c)) for op in ops
                          for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    seen, messages = [], []

    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mode_case=strategy)
    def check(mode_case):
        mode, case = mode_case
        body = case.body
        if isinstance(body, dict):
            # Keep generation short on a CPU.
            for key in ("max_tokens", "max_completion_tokens"):
                if type(body.get(key)) is int and body[key] > 2:
                    body[key] = 2
            body.setdefault("max_tokens", 2)
            if mode == GenerationMode.POSITIVE:
                # Valid per schema but not per model: only one model name, token ids < vocab size.
                if "model" in body:
                    body["model"] = MODEL
                # ... and sampling fields valid together (the schema checks each alone).
                if type(body.get("min_tokens")) is int:
                    body["min_tokens"] = min(body["min_tokens"], 2)
                if type(body.get("n")) is int:
                    body["n"] = min(body["n"], 2)
                if "best_of" in body:
                    body["best_of"] = body.get("n", 1)
                if body.get("top_logprobs") is not None:
                    body["logprobs"] = True
                if isinstance(body.get("logit_bias"), dict):
                    body["logit_bias"] = {str(i): v for i, v in enumerate(body["logit_bias"].values())}
                # ... and content the server can template (the schema lets it be null, as OpenAI's
                # assistant messages with tool calls).
                for m in body.get("messages") or []:
                    if isinstance(m, dict) and m.get("content") is None:
                        m["content"] = "hi"
                p = body.get("prompt")
                if p == "" or p == []:
                    body["prompt"] = "hi"
                elif isinstance(p, list) and p and isinstance(p[0], int):
                    body["prompt"] = [t % 1000 for t in p]
                elif isinstance(p, list) and p and isinstance(p[0], list):
                    body["prompt"] = [[t % 1000 for t in x] for x in p]
        response = case.call(base_url=server.url, timeout=60)
        seen.append(response.status_code)
        if response.status_code == 400 and mode == GenerationMode.POSITIVE and len(messages) < 8:
            messages.append(response.json()["error"]["message"][:160])
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert len(seen) >= 20 and any(s == 200 for s in seen) and any(s == 400 for s in seen), (seen, messages)
    assert _wait_idle(server.engine)


# ---- failures and disconnects ----------------------------------------------------------------------
def test_client_disconnect_frees_kv(server):
    eng = server.engine
    assert _wait_idle(eng)
    aborted = _metric(server.url, "ddtree:request_success_total", finished_reason="abort")
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 2:
                break
        assert eng.blocks.num_free < eng.blocks.num_blocks  # the request holds KV blocks
    # 200 tokens take >10 s here: only an abort frees the pool this soon.
    assert _wait_idle(eng, timeout=5), (eng.blocks.num_free, eng.blocks.num_blocks)
    assert _metric(server.url, "ddtree:request_success_total", finished_reason="abort") == aborted + 1
    # Non-streaming too: the client times out, the server aborts.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert _wait_idle(eng, timeout=5)


def test_injected_request_failure_is_isolated(server, monkeypatch):
    aengine = server.aengine
    original = aengine._make_event

    def failing(live):
        if live.seq.prompt and "FAIL-ME" in live.seq.prompt:
            raise RuntimeError("injected failure")
        return original(live)

    monkeypatch.setattr(aengine, "_make_event", failing)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        good = [client.completions.create(model=MODEL, prompt=p, max_tokens=N_TOKENS, temperature=0)
                for p in PROMPTS]
        bad = client.completions.create(model=MODEL, prompt="FAIL-ME now", max_tokens=N_TOKENS)

        async def bad_stream():
            async with httpx.AsyncClient(timeout=60) as h:
                async with h.stream("POST", f"{server.url}/v1/completions",
                                    json={"prompt": "FAIL-ME stream", "max_tokens": N_TOKENS, "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        return await asyncio.gather(*good, bad, bad_stream(), return_exceptions=True)

    *good, bad, stream_lines = asyncio.run(run())
    for prompt, out in zip(PROMPTS, good):
        assert not isinstance(out, BaseException), out
        assert out.choices[0].text == server.ref[prompt].text
    assert isinstance(bad, openai.APIStatusError) and bad.status_code == ENGINE_ERROR_STATUS
    assert "injected failure" in bad.message
    assert stream_lines[-1] == "data: [DONE]"
    assert "injected failure" in json.loads(stream_lines[-2][6:])["error"]["message"]
    assert _wait_idle(server.engine)


def test_engine_step_failure_fails_that_batch_only(server, monkeypatch):
    eng = server.engine
    original = eng.step
    armed = threading.Event()

    def flaky_step():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected step failure")
        return original()

    monkeypatch.setattr(eng, "step", flaky_step)
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    armed.set()
    assert lines[-1] == "data: [DONE]"
    assert "injected step failure" in json.loads(lines[-2][6:])["error"]["message"]
    assert _wait_idle(eng)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N_TOKENS, temperature=0)
    assert out.choices[0].text == server.ref[PROMPTS[1]].text  # still serving


# ---- SIGTERM -------------------------------------------------------------------------------------
def test_sigterm_shuts_down_cleanly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DDTREE_CACHE_DIR": os.environ.get("DDTREE_CACHE_DIR",
                                                            str(Path(__file__).resolve().parents[1] / ".cache"))}
    log = open(tmp_path / "server.log", "w")
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.server", "--port", str(port), "--device", "cpu",
                             "--drafter", "random", "--budget", "4", "--max-model-len", "256", "--kv-cache-gb",
                             "0.1", "--timeout-graceful-shutdown", "1", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        lines = []
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        t0 = time.monotonic()
                        proc.send_signal(signal.SIGTERM)
        # The in-flight stream got its grace second, then an error event and [DONE].
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert proc.wait(timeout=15) == 0, (tmp_path / "server.log").read_text()
        assert time.monotonic() - t0 < 10
        # the heap frozen while serving is unfrozen at shutdown (else Triton's bindings report
        # its objects as leaked)
        assert "leaked" not in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
