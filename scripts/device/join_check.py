"""Joins that wait (Scheduler.admits) on CUDA: fp32, CUDA graphs and overlapped rounds, a closed
loop at concurrency 8 with mixed output lengths, where requests arrive at a running batch and wait
for a group (join_group 2, so batches of 3-8 wait too) or join_wait_rounds rounds. Every method's
greedy outputs must equal plain decoding's, one request at a time, exactly.

python scripts/device/join_check.py --target X.gguf --prompts .stage/eval_prompts.json --out DIR
"""
import argparse
import json
import random
from pathlib import Path

import torch

from ddtree import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--prompts", required=True)
p.add_argument("--out", required=True)
p.add_argument("--num-prompts", type=int, default=24)
p.add_argument("--device", default="cuda")
args = p.parse_args()
convs = json.loads(Path(args.prompts).read_text())
llm = LLM(target=args.target, method="ddtree", budget="auto", max_budget=64, device=args.device, dtype="float32",
          max_num_seqs=8, kv_cache_gb=4, join_wait_rounds=8)
engine = llm.engine
engine.scheduler.join_group = 2
half = args.num_prompts // 2
prompts = [llm.apply_chat_template(c) for c in convs["humaneval"][:half] + convs["mtbench"][:args.num_prompts - half]]
lengths = [random.Random(i).randint(16, 64) for i in range(len(prompts))]
ref = []
for prompt, n in zip(prompts, lengths):  # plain decoding, one request at a time
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), method="ar", budget=0)
    while not seq.is_finished:
        engine.step()
    ref.append(seq.output_token_ids)
report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "concurrency": 8, "join_wait_rounds": 8, "join_group": 2}
for method, budget in [("ar", 0), ("dflash", 0), ("ddtree", 31), ("ddtree", "auto")]:
    pending, live, done, waited = list(range(len(prompts))), {}, {}, []
    joins0 = engine.scheduler.joins
    while pending or live:
        while pending and len(live) < 8:
            i = pending.pop(0)
            seq = engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True),
                                     method=method, budget=budget)
            live[i] = (seq, engine.scheduler.rounds)
        engine.step()
        for i, (seq, arrived) in list(live.items()):
            if seq.status.value != "waiting" and seq.seq_id not in {s for s, _ in waited}:
                waited.append((seq.seq_id, engine.scheduler.rounds - arrived))
            if seq.is_finished:
                done[i] = seq.output_token_ids
                del live[i]
    same = sum(done[i] == ref[i] for i in range(len(prompts)))
    row = {"identical": same, "of": len(prompts), "joins": engine.scheduler.joins - joins0,
           "requests_that_waited_rounds": sum(w > 1 for _, w in waited), "max_wait_rounds": max(w for _, w in waited)}
    report[f"{method}:{budget}"] = row
    print(method, budget, row, flush=True)
Path(args.out, "join_check_h200.json").write_text(json.dumps(report, indent=1))
