"""Issue 5's goals from one `ddtree bench` grid (AR, chain, one DDTree budget and auto per cell):
prints the summary lines and the README's markdown table, so the figures are computed, not copied.

python scripts/bench_goals.py bench/results/bench_h200_phase10.json \
    --previous bench/results/bench_h200_phase9.json   # adds that grid's B÷AR and auto÷best per cell

A grid with policies side by side (``--methods ...,auto,auto:0.05``) counts ``--auto``'s rows
as auto's (default: plain ``auto``) and prints the others' auto ÷ best line too.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}
STALL_S = 0.01  # a run's collector time worth reporting (a round is ~1 ms on the GPU)


def cells(path: str, auto: str = "auto") -> dict:
    """{(dataset, T, c): {"ar" | "dflash" | "ddtree" | "auto": row}} (one DDTree budget per grid;
    ``auto``: the auto policy whose rows are auto's, e.g. "auto:0.05")."""
    out: dict = {}
    for r in json.loads(Path(path).read_text())["results"]:
        variant = isinstance(r["budget"], str) and r["budget"].startswith("auto")
        if variant and r["budget"] != auto:
            continue
        name = "auto" if variant else r["method"]
        out.setdefault((r["dataset"], r["temperature"], r["concurrency"]), {})[name] = r
    for key, cell in out.items():
        missing = {"ar", "dflash", "ddtree", "auto"} - set(cell)
        if missing:
            raise SystemExit(f"{path}: cell {key} has no {', '.join(sorted(missing))} row "
                             "(the goals need AR, chain, one DDTree budget and auto in every cell)")
    return out


def ratios(cell: dict) -> dict:
    tps = {name: row["tokens_per_s"] for name, row in cell.items()}
    split = cell["ddtree"]["split_s"]
    return {"auto_vs_best": tps["auto"] / max(tps["ar"], tps["dflash"]),
            "tree_vs_chain": tps["ddtree"] / tps["dflash"], "tree_vs_ar": tps["ddtree"] / tps["ar"],
            "tree_work": (split["build"] + split["accept"] + split["commit"]) / sum(split.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid")
    p.add_argument("--previous", help="an earlier grid of the same cells, for the last column")
    p.add_argument("--auto", default="auto", help="the auto policy to count as auto (e.g. auto:0.05)")
    args = p.parse_args()
    grid = cells(args.grid, args.auto)
    previous = cells(args.previous) if args.previous else {}
    budgets = {cell["ddtree"]["budget"] for cell in grid.values()}
    if len(budgets) != 1:
        raise SystemExit(f"{args.grid}: expected one DDTree budget per grid, found {sorted(budgets)}")
    b = budgets.pop()
    rs = {key: ratios(cell) for key, cell in grid.items()}
    c1 = [key for key in rs if key[2] == 1]
    span = lambda xs, f="{:.2f}": f"{f.format(min(xs))}-{f.format(max(xs))}"  # noqa: E731
    ar1 = [grid[k]["ar"]["tokens_per_s"] for k in c1]
    print(f"AR single stream >= 1,000 tok/s: {span(ar1, '{:,.0f}')} ({sum(x >= 1000 for x in ar1)}/{len(ar1)} cells)")
    for goal, name, line in (("tree_vs_chain", "chain", 1.3), ("tree_vs_ar", "AR", 3.0)):
        xs = [rs[k][goal] for k in c1]
        print(f"B={b} >= {line}x {name} at c=1: {span(xs)}x ({sum(x >= line for x in xs)}/{len(xs)} cells)")
    xs = [r["auto_vs_best"] for r in rs.values()]
    print(f"auto >= 1.0x best(AR, chain): {span(xs, '{:.3f}')}x ({sum(x >= 1 for x in xs)}/{len(xs)} cells)")
    policies = {r["budget"] for r in json.loads(Path(args.grid).read_text())["results"]
                if isinstance(r["budget"], str) and r["budget"].startswith("auto")} - {args.auto}
    for other in sorted(policies):
        xs = [ratios(cell)["auto_vs_best"] for cell in cells(args.grid, other).values()]
        print(f"  {other} >= 1.0x best(AR, chain): {span(xs, '{:.3f}')}x ({sum(x >= 1 for x in xs)}/{len(xs)} cells)")
    xs = [100 * r["tree_work"] for r in rs.values()]
    print(f"build + accept + commit <= 10 % of the B={b} round: {span(xs, '{:.1f}')} % ({sum(x <= 10 for x in xs)}/{len(xs)} rows)")
    # Grids since frozen_heap keep what stalled each run: collector time and mid-run captures.
    runs = [(g, n) for cell in grid.values() for row in cell.values()
            for g, n in zip(row.get("gc_s_runs", []), row.get("graphs_captured_runs", []))]
    if runs:
        stalled = sum(g >= STALL_S or n > 0 for g, n in runs)
        print(f"runs with >= {STALL_S * 1e3:.0f} ms of garbage collection or a graph captured mid-run: "
              f"{stalled}/{len(runs)} (collector at most {max(g for g, _ in runs) * 1e3:.1f} ms in a run, "
              f"{sum(n for _, n in runs)} captures)")
    head = ["cell", "AR", "chain", f"B={b}", "auto", "auto ÷ best(AR, chain)", f"B={b} ÷ chain", f"B={b} ÷ AR", f"B={b} τ"]
    if previous:
        head.append("previous grid: B÷AR, auto ÷ best")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for key in sorted(grid, key=lambda k: (k[0] not in DATASETS, k[0], k[1], k[2])):
        cell, r = grid[key], rs[key]
        row = [f"{DATASETS.get(key[0], key[0])} T={key[1]:g} c={key[2]}"]
        row += [f"{cell[m]['tokens_per_s']:,.0f}" for m in ("ar", "dflash", "ddtree", "auto")]
        row += [f"{r['auto_vs_best']:.3f}", f"{r['tree_vs_chain']:.2f}", f"{r['tree_vs_ar']:.2f}", f"{cell['ddtree']['tau']:.2f}"]
        if previous:
            old = ratios(previous[key]) if key in previous else None
            row.append(f"{old['tree_vs_ar']:.2f}, {old['auto_vs_best']:.3f}" if old else "-")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
