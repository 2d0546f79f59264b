"""The CUDA-only engine paths against the eager ones (fp32, random weights; run on the GPU
machine, skipped elsewhere): captured prefill steps (one and several sequences) and overlapped
graph rounds must give the tokens of eager, one-round-at-a-time decoding, and prompt lengths must
not recompile kernels."""
import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.projection import random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512,
             num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
             tie_word_embeddings=True, attention_bias=False, qk_norm=False)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target, drafter = random_model(SHAPE, 2, 8, "cuda", torch.float32)
    with torch.no_grad():  # sharper logits than the 0.02 init: no near-ties in greedy choices
        target.lm_head.weight.mul_(20)
    return target, drafter


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 64, 100, 250, 700, 33][:n]  # several buckets
    return [torch.randint(1, 4096, (k,), generator=g).tolist() for k in lengths]


def _run(models, method, budget, graphs, overlap, prompts, batched, lengths=None):
    target, drafter = models
    llm = LLM(target=target, drafter=drafter if method != "ar" else None, method=method, budget=budget,
              device="cuda", dtype=torch.float32, max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5,
              cuda_graphs=graphs, overlap_steps=overlap, max_budget=32)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    if lengths is not None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    if batched:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    else:
        outs = [llm.generate([p], params)[0].token_ids for p in prompts]
    return outs, llm


# Budget 32 with 3 query heads per KV head: a tree takes several query tiles of the attention
# kernel (the layout that once wrote past a sequence's last query on the H200).
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 32), ("ddtree", "auto")])
def test_graphs_and_overlap_match_eager(models, method, budget):
    prompts = _prompts(8)
    eager, _ = _run(models, method, budget, graphs=False, overlap=False, prompts=prompts, batched=False)
    for batched in (False, True):
        fast, llm = _run(models, method, budget, graphs=True, overlap=True, prompts=prompts, batched=batched)
        assert fast == eager
        assert llm.engine.overlapped_rounds > 10
        captured = set(llm.engine.runner.prefill_graphs)  # (tokens, sequences) buckets
        if batched:  # the 8 prompts are prefilled together: 1,201 tokens
            assert (2048, 16) in captured
        else:
            assert {(t, 1) for t in (16, 32, 64, 128, 256, 1024)} <= captured
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    # Mixed lengths, batched: rounds stay overlapped while requests finish inside them.
    lengths = [64, 20, 37, 64, 9, 50, 64, 30]
    mixed, llm = _run(models, method, budget, graphs=True, overlap=True, prompts=prompts, batched=True,
                      lengths=lengths)
    assert mixed == [e[:n] for e, n in zip(eager, lengths)]
    assert llm.engine.runner.decode_calls - llm.engine.overlapped_rounds <= 1 + len(prompts)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def _compiled_variants(kernel) -> int:
    # device_caches[device][0] is Triton's compiled-kernel dict (3.x): one entry per specialisation
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_prompt_lengths_do_not_recompile_attention(models):
    from ddtree.kernels import triton_attention
    kernel = triton_attention._tree_attention_kernel
    _run(models, "ddtree", 16, graphs=False, overlap=False, prompts=_prompts(3, seed=1), batched=False)  # BLOCK_M 16, 32, 64
    before = _compiled_variants(kernel)
    assert before > 0
    base = _prompts(1, seed=2)[0]
    _run(models, "ddtree", 16, graphs=False, overlap=False, batched=False,
         prompts=[base[:k] for k in (2, 3, 4, 16, 31, 32, 48, 160, 161)])
    assert _compiled_variants(kernel) == before


def test_fused_context_store_matches_torch_path(models, monkeypatch):
    """The drafter's context update on CUDA (one K/V GEMM for all layers + Triton rope/store)
    writes what the per-layer torch path writes."""
    _, drafter = models
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = 37
    taps = torch.randn(T, drafter.fc.in_features, device="cuda", generator=gen)
    positions = torch.arange(100, 100 + T, device="cuda")
    slots = torch.randperm(256, device="cuda", generator=gen)[:T]
    layers, heads, dim = drafter.kv_shape()
    caches = [torch.zeros(layers, 2, 256, heads, dim, device="cuda") for _ in range(2)]
    with torch.inference_mode():
        drafter.store_context(taps, positions, caches[0], slots)
        monkeypatch.setenv("DDTREE_TRITON", "0")
        drafter.store_context(taps, positions, caches[1], slots)
    assert caches[0].abs().sum() > 0
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)


def test_drafter_training_on_cuda_matches_cpu_and_learns(models, tmp_path):
    """Training takes the torch path under autograd (the Triton kernels have no backward) while the
    frozen target's taps still run on the kernels; the first loss equals the CPU's (bf16 autocast
    on CUDA) and training learns the counting pattern."""
    import copy
    import json

    from test_train import write_sequences
    from ddtree.train.trainer import TrainConfig, train_drafter
    target = models[0]
    write_sequences(tmp_path / "responses.pt")
    cfg = TrainConfig(num_layers=1, num_taps=2, block_size=4, steps=100, batch_size=8, anchors=8, max_len=64,
                      lr=1e-2)
    train_drafter(copy.deepcopy(target).cpu(), tmp_path / "responses.pt", tmp_path / "cpu",
                  TrainConfig(**{**cfg.__dict__, "steps": 1}), log_every=1)
    train_drafter(target, tmp_path / "responses.pt", tmp_path / "cuda", cfg, log_every=1)
    cpu = [json.loads(line) for line in (tmp_path / "cpu" / "train_log.jsonl").read_text().splitlines()]
    cuda = [json.loads(line) for line in (tmp_path / "cuda" / "train_log.jsonl").read_text().splitlines()]
    assert cuda[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=0.02)
    assert cuda[-1]["loss"] < 0.7 * cuda[0]["loss"]
