# Profile of test_processed_requests_beside_graph_rounds's workload (eleventh session, 2026-12-05)
# Usage: python scripts/device/profile_processed.py cpu|cuda (run from the repo root; the test's random model,
# 4 prompts with 2 processed requests under cProfile, then the float64 reference, with Triton variant counts).
# On an H100 (bench/results/profile_processed_h100.log) generate took 36 s, mostly first compiles, and the
# reference had not finished when the call timed out: AttentionContext.contiguous used a page as long as
# the sequence, a compile-time constant of the attention kernel, so every length compiled a new kernel.
import sys, time, cProfile, pstats, torch
sys.path.insert(0, "tests")
from ddtree import LLM, SamplingParams
from ddtree.bench.projection import random_model
from test_cuda_engine import SHAPE, _prompts
from test_processing import reference_greedy
dev = sys.argv[1]
torch.manual_seed(0)
target, drafter = random_model(SHAPE, 2, 8, dev, torch.float32)
with torch.no_grad():
    target.lm_head.weight.mul_(20)
prompts = _prompts(4)
kw = dict(cuda_graphs=True, overlap_steps=True) if dev == "cuda" else {}
t = time.time()
llm = LLM(target=target, drafter=drafter, method="ddtree", budget=32, device=dev, dtype=torch.float32,
          max_model_len=1024, max_num_seqs=8, kv_cache_gb=0.5, max_budget=32, **kw)
print("construct", time.time() - t)
processed = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.8,
                           frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={7: 3.0})
params = [processed if i % 2 else SamplingParams(temperature=0, max_tokens=64, ignore_eos=True) for i in range(4)]
t = time.time()
pr = cProfile.Profile(); pr.enable()
outs = llm.generate(prompts, params)
pr.disable()
print("generate", time.time() - t)
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
import triton, ddtree.kernels as K, importlib, pkgutil
def variants():
    out = {}
    for m in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module("ddtree.kernels." + m.name)
        for n, f in vars(mod).items():
            if isinstance(f, triton.runtime.jit.JITFunction) and getattr(f, "device_caches", None):
                out[n] = sum(len(c[0]) for c in f.device_caches.values())
    return out
print("variants after generate", variants())
v0 = variants()
t = time.time()
pr = cProfile.Profile(); pr.enable()
for i in (1, 3):
    assert outs[i].token_ids == reference_greedy(target, prompts[i], processed, set())
pr.disable(); print("reference", time.time() - t)
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
print("variants after reference", {k: v for k, v in variants().items() if v != v0.get(k)})
