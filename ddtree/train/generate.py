"""Stage 2 of drafter training: regenerate responses with the target through our engine.

Prompts (JSONL of chat messages) -> chat template -> batched generation -> a token file
(``responses.pt``: flat int32 tokens, per-sequence offsets and prompt lengths). Resumable: it
appends in chunks and skips prompts already done."""
from __future__ import annotations

import json
import lzma
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ddtree.engine.llm import LLM, chat_template_ids
from ddtree.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 1024
PACKED_FORMAT = "ddtree-responses-1"


def load_sequences(path: Path) -> dict:
    if path.exists():
        return torch.load(path)
    return {"tokens": torch.zeros(0, dtype=torch.int32), "offsets": [0], "prompt_lens": [], "done": 0,
            "generated_tokens": 0, "seconds": 0.0}


def prompt_within(template, messages: list[dict], limit: int) -> list[int]:
    """The templated prompt in at most ``limit`` tokens (``template``: conversations -> ids, e.g.
    ``LLM.apply_chat_templates``): a conversation first loses its oldest (user, assistant) pairs,
    so the last user turn stays whole; a single turn is cut at its end."""
    ids = template([messages])[0]
    while len(ids) > limit and len(messages) >= 3:
        messages = messages[2:]
        ids = template([messages])[0]
    return ids[:limit]


def prompts_within(template, conversations: list[list[dict]], limit: int) -> list[list[int]]:
    """``prompt_within`` for a chunk: one batched tokenizer call for all of them (the GPU waits
    while the host templates a chunk), the pair-dropping loop only for those over ``limit``."""
    ids = template(conversations)
    return [x if len(x) <= limit else prompt_within(template, c, limit) for x, c in zip(ids, conversations)]


def generate_responses(prompts_path: str | Path, out_path: str | Path, target=None, max_new_tokens: int = 256,
                       chunk: int = 1024, max_prompts: int | None = None, temperatures=(0.0, 1.0),
                       max_seconds: float | None = None, device=None, dtype=None, max_num_seqs: int = 512,
                       kv_cache_gb: float = 16.0, seed: int | None = None, past_eos: float = 0.0) -> dict:
    """Generate responses for the prompts; alternate ``temperatures`` across prompts. ``seed``
    seeds the sampling, so passes with other seeds give other responses to the same prompts.
    ``past_eos``: the fraction of prompts (spread evenly) whose responses ignore EOS and run to
    ``max_new_tokens``: what the target writes after its answer (SmolLM2 makes up a new turn), the
    text a request with ``ignore_eos`` (a fixed-length benchmark) asks the drafter to follow."""
    if not 0.0 <= past_eos <= 1.0:
        raise ValueError(f"past_eos must be within [0, 1], got {past_eos}")
    prompts = [json.loads(line) for line in Path(prompts_path).read_text().split("\n") if line.strip()]
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    out_path = Path(out_path)
    data = load_sequences(out_path)
    # The engine takes the seed: on CUDA its sampler draws its own seed when it is built, so seeding
    # torch afterwards (as until 2026-12-04) left every T=1 pass on the GPU with the same responses.
    # A resumed pass does not repeat its draws.
    prompt_limit = MAX_MODEL_LEN - max_new_tokens - 1
    if data["done"] and data.setdefault("prompt_limit", prompt_limit) != prompt_limit:
        raise ValueError(f"{out_path} was generated with prompts cut at {data['prompt_limit']} tokens; "
                         f"--max-new-tokens {max_new_tokens} would cut them at {prompt_limit}")
    data["prompt_limit"] = prompt_limit
    made_with = data.get("past_eos", 0.0)  # passes from before the option: 0
    if data["done"] and made_with != past_eos:
        raise ValueError(f"{out_path} was generated with past_eos {made_with}, not {past_eos}")
    data["past_eos"] = past_eos
    if data["done"] >= len(prompts):  # a finished pass (e.g. unpacked): nothing to load the target for
        return _pass_stats(data)
    llm = LLM(target=target, method="ar", device=device, dtype=dtype, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=16384, kv_cache_gb=kv_cache_gb,
              seed=0 if seed is None else seed + data["done"])
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), initial=data["done"], desc="responses")
    while data["done"] < len(prompts):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        batch = prompts[data["done"]:data["done"] + chunk]
        ids = prompts_within(llm.apply_chat_templates, [p["messages"] for p in batch], prompt_limit)
        params = [SamplingParams(temperature=temperatures[j % len(temperatures)], max_tokens=max_new_tokens,
                                 ignore_eos=int((j + 1) * past_eos) > int(j * past_eos))
                  for j in range(data["done"], data["done"] + len(batch))]
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
    return _pass_stats(data)


def _pass_stats(data: dict) -> dict:
    return {"sequences": data["done"], "generated_tokens": data["generated_tokens"],
            "seconds": data["seconds"], "tokens_per_s": data["generated_tokens"] / max(data["seconds"], 1e-9)}


def _prompt_crc(tokens: torch.Tensor, offsets, prompt_lens) -> int:
    crc = 0
    for start, n in zip(offsets, prompt_lens):
        crc = zlib.crc32(tokens[start:start + n].numpy().astype("<u2").tobytes(), crc)
    return crc


def pack_responses(data_path: str | Path, out_path: str | Path) -> dict:
    """A pass's responses without their prompts, as lzma-compressed uint16 (64 greedy responses:
    7 % of their .pt): small enough to bring back from a device call and carry to the next one, so a
    pass that is worth training on again (the greedy one) is generated once. The prompt tokens
    come back from the prompts file by ``unpack_responses``; their CRC-32 checks that they do."""
    data = torch.load(data_path)
    tokens, offsets, prompt_lens = data["tokens"], data["offsets"], data["prompt_lens"]
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise ValueError(f"{data_path}: token ids outside 0..65535 cannot be packed as uint16")
    n = len(prompt_lens)
    responses = torch.cat([tokens[offsets[i] + prompt_lens[i]:offsets[i + 1]] for i in range(n)]) if n else tokens
    header = {"format": PACKED_FORMAT, "sequences": n, "prompt_lens": list(map(int, prompt_lens)),
              "response_lens": [offsets[i + 1] - offsets[i] - prompt_lens[i] for i in range(n)],
              # every pass before the limit was stored used 256 new tokens: 1024 - 256 - 1
              "prompt_limit": data.get("prompt_limit", MAX_MODEL_LEN - 256 - 1),
              "past_eos": data.get("past_eos", 0.0),
              "prompt_crc32": _prompt_crc(tokens, offsets[:-1], prompt_lens),
              "generated_tokens": data["generated_tokens"], "seconds": data["seconds"]}
    with lzma.open(out_path, "wb", preset=1) as f:
        f.write((json.dumps(header) + "\n").encode())
        np.save(f, responses.numpy().astype("<u2"), allow_pickle=False)
    return {"sequences": n, "response_tokens": len(responses), "bytes": Path(out_path).stat().st_size}


def unpack_responses(packed_path: str | Path, prompts_path: str | Path, out_path: str | Path,
                     target=None, chunk: int = 4096) -> dict:
    """The .pt that ``pack_responses`` packed, its prompts templated again from ``prompts_path``
    (the same prompts file, in the same order) with the target's tokenizer."""
    from ddtree.models.loader import load_tokenizer, resolve_target
    try:
        with lzma.open(packed_path, "rb") as f:
            header = json.loads(f.readline())
            if not isinstance(header, dict) or header.get("format") != PACKED_FORMAT:
                raise ValueError
            responses = torch.from_numpy(np.load(f, allow_pickle=False).astype(np.int32))
    except (lzma.LZMAError, EOFError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{packed_path}: not a packed responses file ({PACKED_FORMAT})") from e
    n = header["sequences"]
    prompts = [json.loads(line) for line in Path(prompts_path).read_text().split("\n") if line.strip()]
    if len(prompts) < n:
        raise ValueError(f"{prompts_path} has {len(prompts)} prompts; {packed_path} answers {n}")
    tokenizer = load_tokenizer(resolve_target(target))
    template = lambda conversations: chat_template_ids(tokenizer, conversations)  # noqa: E731
    pieces, offsets, prompt_lens, at = [], [0], [], 0
    for start in range(0, n, chunk):
        batch = [p["messages"] for p in prompts[start:min(n, start + chunk)]]
        for i, ids in enumerate(prompts_within(template, batch, header["prompt_limit"]), start):
            r = header["response_lens"][i]
            pieces += [torch.tensor(ids, dtype=torch.int32), responses[at:at + r]]
            at += r
            offsets.append(offsets[-1] + len(ids) + r)
            prompt_lens.append(len(ids))
    tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    if prompt_lens != header["prompt_lens"] or _prompt_crc(tokens, offsets[:-1], prompt_lens) != header["prompt_crc32"]:
        raise ValueError(f"{packed_path}: the prompts of {prompts_path}, templated by this target's tokenizer, "
                         "are not those the responses answered (another prompts file, order or tokenizer?)")
    data = {"tokens": tokens, "offsets": offsets, "prompt_lens": prompt_lens, "done": n,
            "generated_tokens": header["generated_tokens"], "seconds": header["seconds"],
            "prompt_limit": header["prompt_limit"], "past_eos": header.get("past_eos", 0.0)}
    torch.save(data, out_path)
    return {"sequences": n, "tokens": len(tokens)}
