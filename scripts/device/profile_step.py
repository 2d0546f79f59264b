"""Where a decode step's time goes on the GPU (random weights of the SmolLM2-135M shape, so no
checkpoint has to travel): wall ms/step of engine.step() vs the GPU time of the step graph
(the difference is host work), the kernels of one eager step (count and GPU time per kernel
kind), the host's hottest Python functions, and the marginal GPU cost of the tree stages: the
round captured without build / accept / commit (their outputs then stay those of the warm-up,
so every other kernel runs unchanged) against the whole round. Per-stage graphs (the bench's
split) add a graph boundary to every stage; the difference of two whole-round graphs does not.

python scripts/device/profile_step.py --out $OUT/profile_step.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from ddtree import LLM
from ddtree.bench.projection import random_model
from ddtree.engine.runner import STAGES, StepGraph, StepKind
from ddtree.engine.sampling_params import SamplingParams

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True, attention_bias=False, qk_norm=False)


def run_steps(llm, method, budget, context, steps, n=1, profile=False):
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    seqs = [engine.add_request(torch.randint(0, 49152, (context,), generator=gen).tolist(),
                               SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True),
                               method=method, budget=budget) for _ in range(n)]
    while any(s.num_cached < len(s) - 1 for s in seqs):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    ctx = len(seqs[0])
    for s in seqs:
        engine.abort(s.request_id)
    gpu = llm.engine.runner.time_graph(method, budget, llm.engine.auto.bucket_of(n), reps=50, context=ctx)
    host = None
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        host = buf.getvalue()
    return wall, gpu, host


def round_ms(llm, method, budget, n, skip=(), context=400, reps=100):
    """GPU ms of one replay of the round captured for bucket n with the ``skip`` stages left out
    (they run once in the warm-up, so their outputs exist)."""
    runner = llm.engine.runner
    original = runner.round_stages

    def round_stages(*args, **kwargs):
        stages = []
        for name, fn in zip(STAGES, original(*args, **kwargs)):
            if name in skip:
                done = []

                def fn(fn=fn, done=done):
                    if not done:
                        done.append(True)
                        fn()
            stages.append(fn)
        return stages

    runner.round_stages = round_stages
    try:
        graph = StepGraph(runner, StepKind(method, budget, "greedy", True), n, runner.graph_pool, split=False,
                          max_keys=runner.max_context)
    finally:
        runner.round_stages = original
    return graph.replay_seconds(context, reps) * 1e3


def prefill_ms(llm, tokens: int, graphs: bool, seqs: int = 1, reps: int = 5) -> float:
    """Wall ms of the prefill step of ``seqs`` prompts of ``tokens`` tokens (captured or eager)."""
    engine = llm.engine
    runner = engine.runner
    runner.use_graphs = graphs
    times = []
    for i in range(reps + 1):
        for j in range(seqs):
            engine.add_request(list(range(1 + i + j, tokens + 1 + i + j)),
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), method="ar")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()  # the prefill
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    runner.use_graphs = True
    return sorted(times[1:])[reps // 2] * 1e3


def kernel_table(llm, method, budget, context, n=1, temperature=0.0):
    """Kernels of one eager step over n sequences (graphs off): name -> (count, total GPU us)."""
    engine = llm.engine
    runner = engine.runner
    runner.use_graphs = False
    params = SamplingParams(temperature=temperature, max_tokens=10**6, ignore_eos=True)
    seqs = [engine.add_request(list(range(1 + i, context + 1 + i)), params, method=method, budget=budget)
            for i in range(n)]
    while any(s.num_cached < len(s) - 1 for s in seqs):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    for s in seqs:
        engine.abort(s.request_id)
    runner.use_graphs = True
    rows = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            rows[e.key[:90]] = (e.count, e.device_time_total)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="profile_step.json")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--force-splits", type=int, default=None, help="attention key splits (default: chosen)")
    p.add_argument("--no-kernels", action="store_true", help="skip the eager kernel tables")
    p.add_argument("--no-overlap", action="store_true", help="read each round before launching the next")
    args = p.parse_args()
    from ddtree.kernels import triton_attention
    chosen = triton_attention.kv_splits_for
    seen = set()

    def splits_for(*a):
        s = chosen(*a) if args.force_splits is None else args.force_splits
        seen.add((a[0], a[1], a[2], s))
        return s
    triton_attention.kv_splits_for = splits_for
    device, dtype = torch.device("cuda"), torch.bfloat16
    target, drafter = random_model(SMOLLM2, 4, 16, device, dtype)
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=63, device=device, dtype=dtype,
              max_model_len=2048, max_num_seqs=16, kv_cache_gb=4, overlap_steps=not args.no_overlap)
    result = {"gpu": torch.cuda.get_device_name(), "context": args.context, "steps": []}
    cands = [("ar", 0), ("dflash", 0), ("ddtree", 63)]
    for n in (1, 4):
        for method, budget in cands:
            wall, gpu, host = run_steps(llm, method, budget, args.context, args.steps, n,
                                        profile=(n == 1 and method == "ar"))
            row = {"n": n, "method": method, "budget": budget,
                   "wall_ms": wall * 1e3, "graph_gpu_ms": gpu * 1e3, "host_ms": (wall - gpu) * 1e3}
            result["steps"].append(row)
            print(f"n={n} {method:6s} B={budget:3d} wall {wall * 1e3:6.3f} ms  "
                  f"graph {gpu * 1e3:6.3f} ms  host {(wall - gpu) * 1e3:6.3f} ms", flush=True)
            if host:
                row["host_profile"] = host
    print("attention launches (programs, max_keys, max_queries, splits):", sorted(seen), flush=True)
    result["marginal_stage_ms"] = []
    for n, budget in ((1, 31), (1, 63), (4, 31)):
        whole = round_ms(llm, "ddtree", budget, n, context=args.context)
        row = {"n": n, "budget": budget, "round_ms": whole}
        for skip in (("build",), ("accept",), ("commit",), ("build", "accept", "commit")):
            row["+".join(skip)] = whole - round_ms(llm, "ddtree", budget, n, skip, context=args.context)
        row["build_accept_commit_share"] = row["build+accept+commit"] / whole
        result["marginal_stage_ms"].append(row)
        print(f"n={n} B={budget}: round {whole:.3f} ms; marginal ms " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if k not in ("n", "budget", "round_ms")), flush=True)
    result["prefill_ms"] = {}
    for seqs, tokens in ((1, 40), (1, 150), (1, 400), (4, 100), (16, 100), (16, 120)):
        eager, graph = prefill_ms(llm, tokens, False, seqs), prefill_ms(llm, tokens, True, seqs)
        result["prefill_ms"][f"{seqs}x{tokens}"] = {"eager": eager, "graph": graph}
        print(f"prefill {seqs:2d} x {tokens:4d} tokens: eager {eager:7.2f} ms  graph {graph:7.2f} ms", flush=True)
    for method, budget in () if args.no_kernels else (("ar", 0), ("dflash", 0), ("ddtree", 63)):
        table = kernel_table(llm, method, budget, args.context)
        total = sum(v[1] for v in table.values())
        count = sum(v[0] for v in table.values())
        result[f"kernels_{method}"] = {"count": count, "gpu_us": total, "by_kernel": table}
        print(f"--- eager {method} step: {count} kernels, {total:.0f} us GPU busy", flush=True)
        for k, (c, us) in list(table.items())[:40]:
            print(f"{us:8.1f} us {c:4d}x  {k}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
