"""Stage 2 of drafter training: regenerate responses with the target through our engine.

Prompts (JSONL of chat messages) -> chat template -> batched generation -> a token file
(``responses.pt``: flat int32 tokens, per-sequence offsets and prompt lengths). Resumable: it
appends in chunks and skips prompts already done."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ddtree.engine.llm import LLM
from ddtree.engine.sampling_params import SamplingParams


def load_sequences(path: Path) -> dict:
    if path.exists():
        return torch.load(path)
    return {"tokens": torch.zeros(0, dtype=torch.int32), "offsets": [0], "prompt_lens": [], "done": 0,
            "generated_tokens": 0, "seconds": 0.0}


def prompt_within(llm: LLM, messages: list[dict], limit: int) -> list[int]:
    """The templated prompt in at most ``limit`` tokens: a conversation first loses its oldest
    (user, assistant) pairs, so the last user turn stays whole; a single turn is cut at its end."""
    ids = llm.apply_chat_template(messages)
    while len(ids) > limit and len(messages) >= 3:
        messages = messages[2:]
        ids = llm.apply_chat_template(messages)
    return ids[:limit]


def prompts_within(llm: LLM, conversations: list[list[dict]], limit: int) -> list[list[int]]:
    """``prompt_within`` for a chunk: one batched tokenizer call for all of them (the GPU waits
    while the host templates a chunk), the pair-dropping loop only for those over ``limit``."""
    ids = llm.apply_chat_templates(conversations)
    return [x if len(x) <= limit else prompt_within(llm, c, limit) for x, c in zip(ids, conversations)]


def generate_responses(prompts_path: str | Path, out_path: str | Path, target=None, max_new_tokens: int = 256,
                       chunk: int = 1024, max_prompts: int | None = None, temperatures=(0.0, 1.0),
                       max_seconds: float | None = None, device=None, dtype=None, max_num_seqs: int = 512,
                       kv_cache_gb: float = 16.0, seed: int | None = None) -> dict:
    """Generate responses for the prompts; alternate ``temperatures`` across prompts. ``seed``
    seeds the sampling, so passes with other seeds give other responses to the same prompts."""
    prompts = [json.loads(line) for line in Path(prompts_path).read_text().split("\n") if line.strip()]
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    out_path = Path(out_path)
    data = load_sequences(out_path)
    # The engine takes the seed: on CUDA its sampler draws its own seed when it is built, so seeding
    # torch afterwards (as until 2026-12-04) left every T=1 pass on the GPU with the same responses.
    # A resumed pass does not repeat its draws.
    llm = LLM(target=target, method="ar", device=device, dtype=dtype, max_model_len=1024,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=16384, kv_cache_gb=kv_cache_gb,
              seed=0 if seed is None else seed + data["done"])
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), initial=data["done"], desc="responses")
    while data["done"] < len(prompts):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        batch = prompts[data["done"]:data["done"] + chunk]
        ids = prompts_within(llm, [p["messages"] for p in batch], 1024 - max_new_tokens - 1)
        params = [SamplingParams(temperature=temperatures[(data["done"] + i) % len(temperatures)],
                                 max_tokens=max_new_tokens) for i in range(len(batch))]
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        data["seconds"] += time.perf_counter() - t0
        new = []
        for p_ids, o in zip(ids, outs):
            seq = p_ids + o.token_ids
            new.append(torch.tensor(seq, dtype=torch.int32))
            data["offsets"].append(data["offsets"][-1] + len(seq))
            data["prompt_lens"].append(len(p_ids))
            data["generated_tokens"] += len(o.token_ids)
        data["tokens"] = torch.cat([data["tokens"]] + new)
        data["done"] += len(batch)
        torch.save(data, out_path)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{data['generated_tokens'] / max(data['seconds'], 1e-9):.0f}")
    bar.close()
    return {"sequences": data["done"], "generated_tokens": data["generated_tokens"],
            "seconds": data["seconds"], "tokens_per_s": data["generated_tokens"] / max(data["seconds"], 1e-9)}
