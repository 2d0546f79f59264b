"""Why the speed grid's tau is below eval-drafter's: DDTree at one budget, T=0, on the grid's c=1
HumanEval requests (the first N prompts), under three protocols: the grid's (lengths 64-192, EOS
ignored; tau split into rounds that start before / after the target's first EOS), the same
lengths stopping at EOS (`ddtree bench --stop-at-eos`), and eval-drafter's (96 tokens, EOS).
    python scripts/study_tau_protocol.py --out bench/results/tau_protocol_cpu.json   # ~10 min on 2 cores
"""
import argparse
import json
import time

from ddtree import LLM, SamplingParams
from ddtree.bench.eval_drafter import eval_conversations
from ddtree.bench.speed import request_lengths

p = argparse.ArgumentParser()
p.add_argument("--prompts", type=int, default=32)
p.add_argument("--budget", type=int, default=63)
p.add_argument("--device", default="cpu")
p.add_argument("--out", required=True)
args = p.parse_args()
if args.prompts < 1 or args.budget < 1:
    p.error(f"--prompts and --budget must be at least 1, got {args.prompts} and {args.budget}")

llm = LLM(method="ddtree", budget=args.budget, max_budget=args.budget, device=args.device, max_num_seqs=4)
engine = llm.engine
ids = llm.apply_chat_templates(eval_conversations()["humaneval"][:args.prompts])


def run(lengths, ignore_eos):
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos),
                               method="ddtree", budget=args.budget) for p, n in zip(ids, lengths)]
    while engine.has_unfinished():
        engine.step()
    before, after = [], []
    for s in seqs:
        out = s.output_token_ids
        eos = next((i for i, t in enumerate(out) if t in engine.eos_token_ids), len(out))
        pos = 0
        for n in s.metrics.accepted_lengths:
            (before if pos <= eos else after).append(n)  # a round that starts at or before EOS
            pos += n
    steps = before + after
    return {"tau": sum(steps) / len(steps), "steps": len(steps), "tokens": sum(steps),
            "tau_before_eos": sum(before) / max(1, len(before)), "steps_before_eos": len(before),
            "tau_after_eos": sum(after) / max(1, len(after)), "steps_after_eos": len(after)}


results = {}
for name, lengths, ignore_eos in [("grid: 64-192 tokens, EOS ignored", request_lengths(128, len(ids), False), True),
                                  ("64-192 tokens, stop at EOS", request_lengths(128, len(ids), False), False),
                                  ("eval-drafter: 96 tokens, stop at EOS", [96] * len(ids), False)]:
    t0 = time.time()
    results[name] = {**run(lengths, ignore_eos), "seconds": time.time() - t0}
    print(name, json.dumps(results[name]), flush=True)
with open(args.out, "w") as f:
    json.dump({"prompts": f"first {len(ids)} HumanEval", "method": f"ddtree B={args.budget} T=0",
               "device": str(llm.device), "dtype": str(llm.dtype), "results": results}, f, indent=1)
