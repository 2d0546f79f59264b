"""GPU correctness and a quick speed table for SmolLM2 + the shipped drafter (one device call).

Greedy outputs of every method (CUDA graphs on) against plain AR with graphs in the same dtype,
and fp32 AR with graphs against eager fp32 AR:
fp32 must match exactly; bf16 may flip on near-ties, so it reports the first divergence per
prompt. Then tokens/s at concurrency 1 for each method.

python scripts/device/gpu_check.py --target X.gguf --prompts .stage/eval_prompts.json --out DIR
"""
import argparse
import json
import time
from pathlib import Path

import torch

from ddtree import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--prompts", required=True)
p.add_argument("--out", required=True)
p.add_argument("--num-prompts", type=int, default=20)
p.add_argument("--max-tokens", type=int, default=96)
args = p.parse_args()
convs = json.loads(Path(args.prompts).read_text())
report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
METHODS = [("ar", 0), ("dflash", 0), ("ddtree", 32), ("ddtree", 128), ("ddtree", "auto")]


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


fp32_ar = None
for dtype in ("float32", "bfloat16"):
    llm = LLM(target=args.target, method="ddtree", budget="auto", max_budget=128, device="cuda", dtype=dtype,
              max_num_seqs=32, kv_cache_gb=4)
    prompts = [llm.apply_chat_template(c) for c in convs["humaneval"][:args.num_prompts // 2]
               + convs["mtbench"][:args.num_prompts - args.num_prompts // 2]]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ref = None
    rows = {}
    for method, budget in METHODS:
        outs = []
        for prompt in prompts:  # one at a time, and all at once below
            r = llm.engine.add_request(prompt, greedy, method=method, budget=budget)
            while not r.is_finished:
                llm.engine.step()
            outs.append(r.output_token_ids)
        for prompt in prompts:
            llm.engine.add_request(prompt, greedy, method=method, budget=budget)
        batch = []
        while llm.engine.has_unfinished():
            batch += [s for s in llm.engine.step() if s.is_finished]
        batch_outs = [s.output_token_ids for s in sorted(batch, key=lambda s: s.seq_id)]
        if ref is None:
            ref = outs
            fp32_ar = fp32_ar or outs
        div = [first_divergence(o, r) for o, r in zip(outs, ref)]
        bdiv = [first_divergence(o, r) for o, r in zip(batch_outs, ref)]
        # The bound: how far each bf16 run stays with fp32 AR, next to bf16 AR's own distance.
        vs_fp32 = [first_divergence(o, r) for o, r in zip(outs, fp32_ar)]
        rows[f"{method}:{budget}"] = {"identical_batch1": sum(d is None for d in div),
                                      "identical_batched": sum(d is None for d in bdiv),
                                      "first_divergence_batch1": div, "first_divergence_batched": bdiv,
                                      "identical_to_fp32_ar": sum(d is None for d in vs_fp32),
                                      "first_divergence_vs_fp32_ar": vs_fp32}
        print(dtype, method, budget, "identical b1", sum(d is None for d in div), "/", len(prompts),
              "batched", sum(d is None for d in bdiv), "vs fp32 AR", sum(d is None for d in vs_fp32), div, vs_fp32,
              flush=True)
    report[f"greedy_{dtype}"] = rows
    if dtype == "float32":
        # The graph paths (captured prefill chunks, overlapped rounds) against eager AR, one round
        # at a time: fp32 must match exactly.
        eager = LLM(target=args.target, method="ar", device="cuda", dtype=dtype, kv_cache_gb=2,
                    cuda_graphs=False, overlap_steps=False)
        eager_outs = [eager.generate([p], greedy)[0].token_ids for p in prompts]
        div = [first_divergence(o, r) for o, r in zip(ref, eager_outs)]
        report["fp32_graph_ar_vs_eager_ar"] = {"identical": sum(d is None for d in div), "first_divergence": div}
        print("fp32 graph AR vs eager AR identical", sum(d is None for d in div), "/", len(prompts), div, flush=True)
        del eager
        continue
    # Seeded sampling runs eagerly, unseeded through graphs: both must produce text.
    sampled = llm.generate(prompts[:4], SamplingParams(temperature=1, max_tokens=32, ignore_eos=True))
    assert all(len(o.token_ids) == 32 for o in sampled)
    speed = {}
    for method, budget in METHODS:
        for warm in (True, False):
            t0 = time.perf_counter()
            toks = steps = 0
            for prompt in prompts[:(2 if warm else 6)]:
                r = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                                           method=method, budget=budget)
                while not r.is_finished:
                    llm.engine.step()
                toks += r.num_output_tokens
                steps += r.metrics.num_verify_steps
            dt = time.perf_counter() - t0
        speed[f"{method}:{budget}"] = {"tokens_per_s": toks / dt, "tau": toks / steps}
        print(f"c=1 {method}:{budget} {toks / dt:8.1f} tok/s tau {toks / steps:.2f}", flush=True)
    report["speed_c1_bf16"] = speed
    report["auto_choices"] = {f"{m}:{b}": k for (m, b), k in llm.engine.step_choices.items()}
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(json.dumps({k: v for k, v in report.items() if k.startswith("speed")}, indent=1))
