"""Drafter evaluation: tau (tokens committed per verify step, bonus included) and the accepted-
length histogram for the DFlash chain and DDTree at several budgets, at T=0 and T=1, on HumanEval
and MT-Bench (first turns). One engine serves every setting through per-request overrides."""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from ddtree.engine.sampling_params import SamplingParams

DEFAULT_BUDGETS = (8, 16, 32, 64, 128, 256)


def eval_conversations() -> dict[str, list[list[dict]]]:
    from ddtree.bench.datasets import humaneval_prompts, mtbench_prompts
    he = [[{"role": "user", "content": "Complete the following Python function.\n\n" + p["prompt"]}]
          for p in humaneval_prompts()]
    mt = [[{"role": "user", "content": q["turns"][0]}] for q in mtbench_prompts()]
    return {"humaneval": he, "mtbench": mt}


def run_setting(llm, prompt_ids, method, budget, temperature, max_tokens, seed) -> dict:
    engine = llm.engine
    seqs = [engine.add_request(ids, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i),
                               method=method, budget=budget) for i, ids in enumerate(prompt_ids)]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    lengths = [n for s in seqs for n in s.metrics.accepted_lengths]
    # A request's last step may be cut short by max_tokens/EOS; count only full steps in tau.
    full = [n for s in seqs for n in s.metrics.accepted_lengths[:-1]] or lengths
    return {"method": method, "budget": budget, "temperature": temperature, "requests": len(seqs),
            "tokens": sum(lengths), "verify_steps": len(lengths), "tau": sum(full) / len(full),
            "tau_all_steps": sum(lengths) / len(lengths), "histogram": dict(sorted(Counter(full).items())),
            "seconds": seconds}


def evaluate(llm, conversations: dict, budgets=DEFAULT_BUDGETS, temperatures=(0.0, 1.0), max_tokens=128,
             seed=0, limit: int | None = None) -> list[dict]:
    results = []
    for name, convs in conversations.items():
        ids = llm.apply_chat_templates(convs[:limit])
        for t in temperatures:
            for method, budget in [("dflash", 0)] + [("ddtree", b) for b in budgets]:
                r = run_setting(llm, ids, method, budget, t, max_tokens, seed)
                r["dataset"] = name
                results.append(r)
                print(f"{name:9s} T={t:.0f} {method:6s} B={budget:3d} tau={r['tau']:.2f} "
                      f"({r['verify_steps']} steps, {r['seconds']:.1f}s)", flush=True)
    return results


def plot(results: list[dict], png: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({r["dataset"] for r in results})
    temps = sorted({r["temperature"] for r in results})
    fig, axes = plt.subplots(2, len(sets), figsize=(6 * len(sets), 8), squeeze=False)
    for j, name in enumerate(sets):
        ax = axes[0, j]
        for t in temps:
            rows = [r for r in results if r["dataset"] == name and r["temperature"] == t]
            tree = sorted((r["budget"], r["tau"]) for r in rows if r["method"] == "ddtree")
            line, = ax.plot([b for b, _ in tree], [x for _, x in tree], "o-", label=f"DDTree T={t:g}")
            chain = [r["tau"] for r in rows if r["method"] == "dflash"]
            if chain:
                ax.axhline(chain[0], ls="--", color=line.get_color(), label=f"DFlash chain T={t:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_ylabel("tau (tokens per verify step)")
        ax.set_title(f"{name}: acceptance vs budget")
        ax.legend()
        ax = axes[1, j]
        for r in results:
            if r["dataset"] == name and r["temperature"] == temps[0] and (
                    r["method"] == "dflash" or r["budget"] == 64):
                h = {int(k): v for k, v in r["histogram"].items()}
                total = sum(h.values())
                xs = sorted(h)
                ax.bar([x + (0.2 if r["method"] == "ddtree" else -0.2) for x in xs], [h[x] / total for x in xs],
                       width=0.4, label=f"{r['method']} B={r['budget']}" if r["method"] == "ddtree" else "DFlash chain")
        ax.set_xlabel(f"tokens committed per step (T={temps[0]:g})")
        ax.set_ylabel("fraction of steps")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    from ddtree import LLM

    p = argparse.ArgumentParser(prog="ddtree eval-drafter", description=__doc__)
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="prompts per dataset (default: all)")
    p.add_argument("--prompts-json", default=None, help="exported eval prompts (default: read the packages)")
    p.add_argument("--export-prompts", default=None, help="write the eval prompts as JSON and exit")
    p.add_argument("--kv-cache-gb", type=float, default=16.0)
    p.add_argument("--out", default="bench/results/eval_drafter.json")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    if args.export_prompts:
        Path(args.export_prompts).write_text(json.dumps(eval_conversations()))
        return 0
    convs = json.loads(Path(args.prompts_json).read_text()) if args.prompts_json else eval_conversations()
    budgets = [int(b) for b in args.budgets.split(",")]
    llm = LLM(target=args.target, drafter=args.drafter, method="ddtree", budget=max(budgets), device=args.device,
              dtype=args.dtype, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384,
              kv_cache_gb=args.kv_cache_gb)
    results = evaluate(llm, convs, budgets, [float(t) for t in args.temperatures.split(",")], args.max_tokens,
                       limit=args.limit)
    meta = {"target": str(llm.target_dir), "drafter": str(args.drafter), "device": str(llm.device),
            "dtype": str(llm.dtype), "max_tokens": args.max_tokens}
    if llm.device.type == "cuda":
        import torch
        meta["gpu"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, args.png or str(Path(args.out).with_suffix(".png")))
    return 0
