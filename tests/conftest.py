import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DDTREE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache"))

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.models.loader import load_target, load_tokenizer, resolve_target  # noqa: E402

USER_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers greater than 50.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Tell me a short story about a robot who learns to paint.",
    "What is 17 times 23?",
    "Give me a haiku about autumn.",
    "Translate 'good morning' into Spanish and German.",
    "What are the benefits of regular exercise?",
    "Write a SQL query that counts rows in a table named users.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a list and a tuple?",
    "Suggest a name for a coffee shop.",
    "hi",
    "Solve for x: 2x + 6 = 14. Show your steps, then explain how you would check the answer "
    "by substituting it back into the original equation.",
    "Describe the water cycle.",
    "Write a JavaScript function that returns the largest number in an array.",
]


@pytest.fixture(scope="session")
def smol_dir():
    return resolve_target(None)


@pytest.fixture(scope="session")
def smol(smol_dir):
    return load_target(smol_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    out = []
    for text in USER_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def make_llm(smol, tokenizer, method="ddtree", budget=16, drafter="random", **kw):
    kw.setdefault("max_model_len", 512)
    kw.setdefault("kv_cache_gb", 0.25)
    kw.setdefault("dtype", torch.float32)
    return LLM(target=smol, tokenizer=tokenizer, method=method, budget=budget,
               drafter=drafter if method != "ar" else None, device="cpu", **kw)


GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="session")
def ar_reference(smol, tokenizer, prompts):
    """Plain autoregressive greedy outputs (64 tokens) of every prompt, batched."""
    llm = make_llm(smol, tokenizer, method="ar")
    outs = llm.generate(prompts, GREEDY_64)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
