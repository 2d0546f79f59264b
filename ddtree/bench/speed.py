"""``ddtree bench``: AR, DFlash chain and DDTree side by side in one run, over the same prompts and
max_tokens, at several concurrency levels and temperatures. Reports tokens/s (aggregate and per
request), tau, speedup over AR and the step-time split (draft / build / verify / accept / commit /
prefill). Writes JSON and a PNG. ``--quick`` runs on a CPU in well under a minute (for CI).

Concurrency c is closed-loop: c requests in flight, a new one joins when one finishes. One engine
serves every method through per-request overrides, so all methods share weights and caches."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ddtree.engine.sampling_params import SamplingParams


def parse_methods(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, budget = item.strip().partition(":")
        if name not in ("ar", "dflash", "ddtree"):
            raise ValueError(f"--methods: unknown method {name!r} (ar, dflash, ddtree:B)")
        if name == "ddtree" and not budget.isdigit():
            raise ValueError(f"--methods: ddtree needs a budget, e.g. ddtree:32 (got {item!r})")
        out.append((name, int(budget) if name == "ddtree" else 0))
    return out


def run_closed_loop(llm, prompt_ids, method, budget, temperature, max_tokens, concurrency) -> dict:
    engine = llm.engine
    timer = engine.runner.timer
    timer.totals.clear()
    pending = list(prompt_ids)
    in_flight, done = [], []
    start = time.perf_counter()
    started = {}
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            seq = engine.add_request(pending.pop(0), SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                                    ignore_eos=True, seed=len(done)),
                                     method=method, budget=budget)
            started[seq.seq_id] = time.perf_counter()
            in_flight.append(seq)
        engine.step()
        now = time.perf_counter()
        for seq in [s for s in in_flight if s.is_finished]:
            in_flight.remove(seq)
            done.append((seq, now - started[seq.seq_id]))
    if engine.runner.device.type == "cuda":
        import torch
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(s.num_output_tokens for s, _ in done)
    lengths = [n for s, _ in done for n in s.metrics.accepted_lengths]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "per_request_tokens_per_s": statistics.median(s.num_output_tokens / t for s, t in done),
            "tau": sum(lengths) / len(lengths), "verify_steps": len(lengths),
            "split_s": dict(timer.totals)}


def bench(llm, prompts: dict[str, list[list[int]]], methods, concurrency, temperatures, max_tokens,
          repeats: int) -> list[dict]:
    rows = []
    for name, ids in prompts.items():
        for t in temperatures:
            for c in concurrency:
                # Warm-up (allocations, kernels), then repeats; medians are reported.
                run_closed_loop(llm, ids[:max(1, c)], "ar", 0, t, min(4, max_tokens), c)
                for method, budget in methods:
                    runs = [run_closed_loop(llm, ids, method, budget, t, max_tokens, c) for _ in range(repeats)]
                    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
                    row = {"dataset": name, "temperature": t, "concurrency": c, "method": method,
                           "budget": budget, "repeats": repeats,
                           "tokens_per_s_runs": [r["tokens_per_s"] for r in runs], **best}
                    rows.append(row)
                    print(f"{name:9s} T={t:g} c={c:3d} {method:6s} B={budget:3d} {row['tokens_per_s']:8.1f} tok/s "
                          f"tau={row['tau']:.2f}", flush=True)
                ar = next((r for r in rows[-len(methods):] if r["method"] == "ar"), None)
                for r in rows[-len(methods):]:
                    r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
    return rows


def plot(rows: list[dict], png: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = lambda r: r["method"] if r["method"] != "ddtree" else f"ddtree B={r['budget']}"  # noqa: E731
    first = (rows[0]["dataset"], rows[0]["temperature"])
    sel = [r for r in rows if (r["dataset"], r["temperature"]) == first]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for lab in dict.fromkeys(label(r) for r in sel):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in sel if label(r) == lab)
        axes[0].plot([c for c, _ in pts], [v for _, v in pts], "o-", label=lab)
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title=f"{first[0]} T={first[1]:g}")
    axes[0].legend()
    c0 = min(r["concurrency"] for r in sel)
    tree = sorted((r["budget"], r["tau"], r["speedup_vs_ar"] or 0) for r in sel
                  if r["method"] == "ddtree" and r["concurrency"] == c0)
    if tree:
        axes[1].plot([b for b, _, _ in tree], [t for _, t, _ in tree], "o-", label="tau")
        axes[1].plot([b for b, _, _ in tree], [s for _, _, s in tree], "s--", label="speedup vs AR")
        axes[1].set(xscale="log", xlabel="budget", title=f"DDTree at concurrency {c0}")
        axes[1].legend()
    stages = ["prefill", "draft", "build", "verify", "accept", "commit"]
    bars = [r for r in sel if r["concurrency"] == c0]
    bottom = [0.0] * len(bars)
    for st in stages:
        vals = [r["split_s"].get(st, 0.0) / max(1, r["verify_steps"]) * 1e3 for r in bars]
        axes[2].bar(range(len(bars)), vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set_xticks(range(len(bars)), [label(r) for r in bars], rotation=30)
    axes[2].set(ylabel="ms per verify step", title=f"step-time split, concurrency {c0}")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    from ddtree import LLM
    from ddtree.engine.args import add_engine_args

    p = argparse.ArgumentParser(prog="ddtree bench", description=__doc__)
    add_engine_args(p)
    p.add_argument("--methods", default="ar,dflash,ddtree:16,ddtree:32,ddtree:64")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: 4 x max concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts-json", default=None, help="exported eval prompts (ddtree eval-drafter --export-prompts)")
    p.add_argument("--quick", action="store_true", help="tiny CPU run for CI: seconds, not minutes")
    p.add_argument("--out", default="bench/results/bench.json")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.device = args.device or "cpu"
        args.methods, args.concurrency, args.temperatures = "ar,dflash,ddtree:8", "1,2", "0"
        args.datasets, args.num_prompts, args.max_tokens, args.repeats = "mtbench", 2, 8, 1
    methods = parse_methods(args.methods)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    budget = max([b for _, b in methods] + [args.budget])
    llm = LLM(target=args.target, drafter=args.drafter, method="ddtree", budget=budget, device=args.device,
              dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(concurrency),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gb=args.kv_cache_gb)
    if args.prompts_json:
        convs = json.loads(Path(args.prompts_json).read_text())
    else:
        from ddtree.bench.eval_drafter import eval_conversations
        convs = eval_conversations()
    n = args.num_prompts or 4 * max(concurrency)
    prompts = {d: [llm.apply_chat_template(c) for c in convs[d][:n]] for d in args.datasets.split(",")}
    rows = bench(llm, prompts, methods, concurrency, [float(t) for t in args.temperatures.split(",")],
                 args.max_tokens, args.repeats)
    meta = {"device": str(llm.device), "dtype": str(llm.dtype), "target": str(llm.target_dir),
            "max_tokens": args.max_tokens, "prompts_per_run": n, "quick": args.quick}
    if llm.device.type == "cuda":
        import torch
        meta["gpu"] = torch.cuda.get_device_name()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    plot(rows, args.png or out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0
