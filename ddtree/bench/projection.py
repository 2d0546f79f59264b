"""Projected speedups for a large target (a PROJECTION, not a measurement of a trained model).

Step costs are measured on this GPU with random weights of a given shape (default Qwen3-8B:
36 layers, hidden 4096, 32/8 heads of 128, vocab 151936) and a random DFlash drafter, through
our engine with CUDA graphs: n real sequences with a ``--context``-token prompt, then timed decode
steps for plain decoding, the DFlash chain and DDTree at each budget. Acceptance cannot be
measured without trained weights, so the projection combines these costs with acceptance curves
measured elsewhere (default: our SmolLM2 drafter's HumanEval curve in
bench/results/eval_drafter.json): projected speedup(n, c) = tau(c) * t(n, ar) / t(n, c).

python -m ddtree.bench.projection --out bench/results/projection_qwen3_8b.json
python -m ddtree.bench.projection --costs-from <earlier projection JSON>   # new tau curve, same costs (no GPU)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree.engine.sampling_params import SamplingParams

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=False, attention_bias=False, qk_norm=True)


def random_model(cfg: dict, drafter_layers: int, block_size: int, device, dtype):
    from ddtree.models.decoder import DecoderLM, ModelConfig
    from ddtree.models.dflash import random_drafter
    with torch.device(device):
        target = DecoderLM(ModelConfig(**cfg)).to(dtype)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.02)
    drafter = random_drafter(target.config, num_layers=drafter_layers, block_size=block_size, num_taps=5,
                             dtype=dtype).to(device, dtype)
    return target, drafter


def step_costs(llm, candidates, batch_sizes, context: int, steps: int) -> dict:
    """Seconds per decode step for each (batch size, candidate), real sequences of ``context``."""
    engine = llm.engine
    vocab = engine.target_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    costs = {}
    for n in batch_sizes:
        for method, budget in candidates:
            seqs = [engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(),
                                       SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True),
                                       method=method, budget=budget) for _ in range(n)]
            while any(s.num_cached < len(s) - 1 for s in seqs):  # prefill
                engine.step()
            for _ in range(3):  # capture + warm
                engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            costs[(n, method, budget)] = (time.perf_counter() - t0) / steps
            for s in seqs:
                engine.abort(s.request_id)
            print(f"n={n:3d} {method:6s} B={budget:3d} {costs[(n, method, budget)] * 1e3:7.2f} ms/step", flush=True)
    return costs


def tau_curve(path: Path, dataset: str) -> dict:
    rows = json.loads(path.read_text())
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    curve = {}
    for r in rows:
        if r.get("dataset") == dataset and float(r.get("temperature", 0)) == 0:
            key = ("dflash", 0) if r["method"] in ("chain", "dflash") else ("ddtree", int(r["budget"]))
            curve[key] = float(r["tau"])
    curve[("ar", 0)] = 1.0
    return curve


def plot(out: dict, png) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = dict.fromkeys((r["method"], r["budget"]) for r in rows)
    for method, budget in labels:
        pts = [r for r in rows if (r["method"], r["budget"]) == (method, budget)]
        name = method if method != "ddtree" else f"ddtree B={budget}"
        xs = [r["batch_size"] for r in pts]
        axes[0].plot(xs, [r["step_cost_vs_ar"] for r in pts], "o-", label=name)
        axes[1].plot(xs, [r["projected_speedup_vs_ar"] or 0 for r in pts], "o-", label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="batch size", ylabel="step time / AR step time",
                title=f"measured step cost, {out['gpu']}, random Qwen3-8B shape")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(xscale="log", xlabel="batch size", ylabel="tau x AR step / step",
                title="PROJECTED speedup vs AR (tau from " + out["tau_source"].split(" ")[0].split("/")[-1] + ")")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    from ddtree import LLM
    p = argparse.ArgumentParser(prog="python -m ddtree.bench.projection", description=__doc__)
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--budgets", default="8,16,32,64,128")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tau-json", default="bench/results/eval_drafter.json")
    p.add_argument("--tau-dataset", default="humaneval")
    p.add_argument("--out", default="bench/results/projection_qwen3_8b.json")
    p.add_argument("--costs-from", default=None,
                   help="reuse the step costs of an earlier projection JSON (its GPU, shape and context)")
    args = p.parse_args(argv)
    if args.costs_from:
        earlier = json.loads(Path(args.costs_from).read_text())
        costs = {(r["batch_size"], r["method"], r["budget"]): r["step_s"] for r in earlier["rows"]}
        sizes = sorted({n for n, _, _ in costs})
        candidates = list(dict.fromkeys((m, b) for _, m, b in costs))
        gpu, args.drafter_layers, args.context = earlier["gpu"], earlier["drafter_layers"], earlier["context"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the projection measures GPU step costs: it needs CUDA (or --costs-from)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        budgets = [int(x) for x in args.budgets.split(",")]
        target, drafter = random_model(QWEN3_8B, args.drafter_layers, args.block_size, device, dtype)
        llm = LLM(target=target, drafter=drafter, method="ddtree", budget=max(budgets), device=device, dtype=dtype,
                  max_model_len=args.context + 512, max_num_seqs=max(sizes), kv_cache_gb=24)
        candidates = [("ar", 0), ("dflash", 0)] + [("ddtree", b) for b in budgets]
        costs = step_costs(llm, candidates, sizes, args.context, args.steps)
        gpu = torch.cuda.get_device_name()
    tau = tau_curve(Path(args.tau_json), args.tau_dataset)
    rows = []
    for n in sizes:
        for method, budget in candidates:
            t = costs[(n, method, budget)]
            speed = tau.get((method, budget))
            rows.append({"batch_size": n, "method": method, "budget": budget, "step_s": t,
                         "step_cost_vs_ar": t / costs[(n, "ar", 0)], "tau": speed,
                         "projected_speedup_vs_ar": None if speed is None else speed * costs[(n, "ar", 0)] / t})
    best = {n: max((r for r in rows if r["batch_size"] == n and r["tau"] is not None),
                   key=lambda r: r["projected_speedup_vs_ar"]) for n in sizes}
    out = {"kind": "PROJECTION: measured step costs (random weights) x acceptance measured elsewhere",
           "gpu": gpu, "shape": QWEN3_8B, "costs_from": args.costs_from, "drafter_layers": args.drafter_layers,
           "context": args.context, "tau_source": f"{args.tau_json} ({args.tau_dataset}, T=0)",
           "rows": rows, "best_per_batch_size": {str(n): [b["method"], b["budget"], b["projected_speedup_vs_ar"]]
                                                 for n, b in best.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"{'n':>4} {'method':>8} {'B':>4} {'ms/step':>8} {'cost/AR':>8} {'tau':>5} {'proj. speedup':>13}")
    for r in rows:
        print(f"{r['batch_size']:4d} {r['method']:>8} {r['budget']:4d} {r['step_s'] * 1e3:8.2f} "
              f"{r['step_cost_vs_ar']:8.2f} {r['tau'] or 0:5.2f} {r['projected_speedup_vs_ar'] or 0:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
