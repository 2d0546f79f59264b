"""Join `ddtree bench` JSONs of one session (e.g. the c=1 sweep and the c=4-64 grid, run back to
back on the same machine because one device call is limited to 10 minutes) into one file + plots.

python scripts/merge_bench.py bench/results/a.json bench/results/b.json --out bench/results/c.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree.bench.speed import plot


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    parts = [json.loads(Path(f).read_text()) for f in args.inputs]
    rows = [r for part in parts for r in part["results"]]
    order = {k: i for i, k in enumerate(dict.fromkeys((r["dataset"], r["temperature"]) for r in rows))}
    rows.sort(key=lambda r: (order[(r["dataset"], r["temperature"])], r["concurrency"]))
    out = Path(args.out)
    out.write_text(json.dumps({"meta": {"parts": [{"file": f, **part["meta"]} for f, part in zip(args.inputs, parts)]},
                               "results": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    for t in sorted({r["temperature"] for r in rows}):  # the plot shows the first (dataset, T)
        if t != rows[0]["temperature"]:
            plot([r for r in rows if r["temperature"] == t], out.with_name(out.stem + f"_t{t:g}.png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
