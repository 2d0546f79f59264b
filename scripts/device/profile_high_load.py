"""Where the host's time goes under load: plain decoding and ``auto`` side by side at one
concurrency (closed loop, the bench's protocol), each run once plain and once under cProfile.
Shows which Python functions ``auto`` adds per round (choosing, tap-cache writes, catch-ups,
prefill of prompt context) when its rounds are plain decoding anyway.

python scripts/device/profile_high_load.py --target <gguf> --prompts-json .stage/eval_prompts.json \
    --concurrency 64 --out $OUT/profile_high_load.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

from ddtree import LLM
from ddtree.bench.speed import request_lengths, run_closed_loop, warm_up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    c = args.concurrency
    llm = LLM(target=args.target, method="ddtree", budget="auto", max_num_seqs=c, kv_cache_gb=8)
    llm.engine.profile_auto(modes=("sample",) if args.temperature > 0 else ("greedy",))
    convs = json.load(open(args.prompts_json))[args.dataset]
    count = 4 * c
    ids = [llm.apply_chat_template(convs[i % len(convs)]) for i in range(count)]
    lengths = request_lengths(args.max_tokens, count, False)
    rows = []
    for method, budget in (("ar", 0), ("ddtree", "auto")):
        warm_up(llm, ids, method, budget, args.temperature, c, lengths)
        plain = [run_closed_loop(llm, ids, method, budget, args.temperature, lengths, c) for _ in range(2)]
        prof = cProfile.Profile()
        prof.enable()
        profiled = run_closed_loop(llm, ids, method, budget, args.temperature, lengths, c)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        rows.append({"method": method, "budget": budget, "tokens_per_s": [r["tokens_per_s"] for r in plain],
                     "engine_decode_steps": plain[-1]["engine_decode_steps"],
                     "auto_choices": plain[-1]["auto_choices"],
                     "profiled_wall_s": profiled["wall_s"], "host_profile": buf.getvalue()})
        print(f"{method}:{budget} c={c} tok/s {[round(r['tokens_per_s']) for r in plain]} "
              f"steps {plain[-1]['engine_decode_steps']} {plain[-1]['auto_choices']} "
              f"profiled wall {profiled['wall_s']:.3f} s", flush=True)
    json.dump({"concurrency": c, "dataset": args.dataset, "temperature": args.temperature, "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
