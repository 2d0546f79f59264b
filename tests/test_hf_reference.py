"""Independent reference: Hugging Face transformers' own Llama implementation on the same
weights. Greedy continuations must agree (first 32 tokens) on >= 90% of 20 prompts, and the
logits of a prefill must match closely."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from ddtree import SamplingParams
from ddtree.context import AttentionContext

from conftest import make_llm


@pytest.fixture(scope="module")
def hf_model(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def test_prefill_logits_match_hf(smol, hf_model, prompts):
    ids = prompts[1]
    n = len(ids)
    kv = [(torch.zeros(n, 3, 64), torch.zeros(n, 3, 64)) for _ in range(30)]
    ctx = AttentionContext.contiguous([n])
    with torch.no_grad():
        hidden, _ = smol(torch.tensor(ids), torch.arange(n), kv, ctx)
        ours = smol.logits(hidden)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-3), float((ours - ref).abs().max())


def test_greedy_matches_hf_generate(smol, tokenizer, hf_model, prompts):
    llm = make_llm(smol, tokenizer, method="ar")
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    agree = 0
    with torch.no_grad():
        for p, o in zip(prompts, ours):
            ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=0)
            agree += ref[0, len(p):].tolist() == o.token_ids
    assert agree >= 18, f"only {agree}/20 prompts agree with transformers"
