"""Host time to template a chunk of training prompts: one tokenizer call per prompt (as
`train-drafter generate` did) against one batched call per chunk (`prompts_within`). The GPU
waits while the host templates a chunk, so this is time taken from each generation pass.

python scripts/bench_chat_templates.py --prompts prompts.jsonl --out bench/results/chat_templates_cpu.json
(prompts.jsonl from `ddtree train-drafter prompts ... --n-sharegpt-later 40000`)"""
import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from ddtree import LLM
from ddtree.models.loader import load_target, load_tokenizer, resolve_target
from ddtree.train.generate import prompt_within, prompts_within


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", required=True)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--limit", type=int, default=767, help="prompt token limit (generate: 1024 - 256 - 1)")
    p.add_argument("--out", default="bench/results/chat_templates_cpu.json")
    args = p.parse_args()
    path = resolve_target(None)
    llm = LLM(target=load_target(path, device="cpu"), tokenizer=load_tokenizer(path), method="ar",
              device="cpu", dtype=torch.float32, max_model_len=1024, kv_cache_gb=0.05)
    convs = [json.loads(line)["messages"] for line in Path(args.prompts).read_text().split("\n") if line.strip()]
    rows = []
    for name, chunk in (("first prompts", convs[:args.chunk]), ("last prompts", convs[-args.chunk:])):
        t0 = time.perf_counter()
        one = [prompt_within(llm.apply_chat_templates, c, args.limit) for c in chunk]
        t1 = time.perf_counter()
        batched = prompts_within(llm.apply_chat_templates, chunk, args.limit)
        t2 = time.perf_counter()
        if one != batched:
            raise SystemExit(f"{name}: batched ids differ from one-at-a-time ids")
        rows.append({"prompts": name, "n": len(chunk), "one_at_a_time_ms": (t1 - t0) / len(chunk) * 1e3,
                     "batched_ms": (t2 - t1) / len(chunk) * 1e3, "speedup": (t1 - t0) / (t2 - t1)})
        print(f"{name:13} one at a time {rows[-1]['one_at_a_time_ms']:.2f} ms/prompt, "
              f"batched {rows[-1]['batched_ms']:.2f} ms/prompt, {rows[-1]['speedup']:.2f}x (ids equal)")
    Path(args.out).write_text(json.dumps({"machine": f"{platform.processor() or platform.machine()}, "
                                                     f"{os.cpu_count()} cores", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
