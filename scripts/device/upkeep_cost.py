"""What `budget="auto"` pays to keep the drafter's context current while it decodes plainly: GPU
time of the plain-decoding step graph without it, with the deferred store (the tapped features
into the tap cache; what auto runs) and with the drafter's K/V stored every round (taps + the
drafter's K/V projection; before the tap cache), per batch bucket, random weights of the
SmolLM2-135M shape + a 4-layer drafter. Also the catch-up a speculative round runs after plain
ones (host time to launch it, GPU time), by number of deferred tokens.

python scripts/device/upkeep_cost.py --out $OUT/upkeep_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from ddtree import LLM
from ddtree.bench.projection import random_model
from ddtree.engine.runner import StepKind

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True, attention_bias=False, qk_norm=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--buckets", default="1,4,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default="bench/results/upkeep_cost.json")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    target, drafter = random_model(SMOLLM2, 4, 16, device, dtype)
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget="auto", device=device, dtype=dtype,
              max_model_len=2048, max_num_seqs=64, kv_cache_gb=4)
    runner = llm.engine.runner
    tap_cache, kept = runner.tap_cache, []
    rows = []
    for bucket in [int(b) for b in args.buckets.split(",")]:
        for sampling in ("greedy", "sample"):
            ms = {}
            for name, ctx, taps in (("plain", False, tap_cache), ("deferred", True, tap_cache),
                                    ("stored", True, None)):
                runner.tap_cache = taps
                kind = StepKind("ar", 0, sampling, ctx)
                ms[name] = runner._graph(kind, bucket, runner.max_context).replay_seconds(args.context, args.reps) * 1e3
                # captured with this tap cache setting; kept alive (its memory is in the graph pool)
                kept.append(runner.graphs.pop((kind, bucket, runner.max_context, False)))
            rows.append({"bucket": bucket, "sampling": sampling, "plain_ms": ms["plain"],
                         "deferred_ms": ms["deferred"], "stored_ms": ms["stored"],
                         "deferred_fraction": ms["deferred"] / ms["plain"] - 1,
                         "stored_fraction": ms["stored"] / ms["plain"] - 1})
            print(f"n={bucket:3d} {sampling:6s} plain {ms['plain']:.3f} ms  deferred {ms['deferred']:.3f} ms "
                  f"(+{100 * rows[-1]['deferred_fraction']:.1f}%)  stored {ms['stored']:.3f} ms "
                  f"(+{100 * rows[-1]['stored_fraction']:.1f}%)", flush=True)
    runner.tap_cache = tap_cache
    catch_up = []
    for seqs, steps in ((1, 1), (16, 4), (64, 1), (64, 32), (64, 84)):
        # what the first speculative round after `steps` plain ones projects first
        n = seqs * steps
        slots = np.arange(n, dtype=np.int64)
        positions = np.arange(n, dtype=np.int64) % 1024
        host, gpu = [], []
        for _ in range(args.reps // 5 + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            runner.catch_up(slots, positions)
            end.record()
            host.append(time.perf_counter() - t0)
            end.synchronize()
            gpu.append(start.elapsed_time(end) / 1e3)
        catch_up.append({"sequences": seqs, "plain_rounds": steps, "tokens": n,
                         "host_ms": statistics.median(host[1:]) * 1e3, "gpu_ms": statistics.median(gpu[1:]) * 1e3})
        print(f"catch-up of {n:5d} tokens: host {catch_up[-1]['host_ms']:.3f} ms, "
              f"GPU {catch_up[-1]['gpu_ms']:.3f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "context": args.context, "rows": rows,
                   "catch_up": catch_up}, f, indent=1)


if __name__ == "__main__":
    main()
