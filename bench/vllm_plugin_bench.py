"""vLLM without speculation vs vLLM DFlash (our drafter) vs vLLM + the DDTree plugin, side by side.

One engine per method, each in its own child process (fresh vLLM), same prompts (HumanEval as
chat messages, the drafter evaluation's prompts), greedy, same max_tokens. Concurrency 1 runs the
prompts one by one; concurrency c>1 submits them together with max_num_seqs=c. τ (tokens committed
per verify step, bonus included) comes from vLLM's own spec-decode counters.

    .venv/bin/python bench/vllm_plugin_bench.py            # writes bench/results/vllm_plugin_cpu.{json,png}
    .venv/bin/python bench/vllm_plugin_bench.py --budget 8,16,32   # several tree budgets, one run
    .venv/bin/python bench/vllm_plugin_bench.py --repeats 3        # methods interleaved, 3 rounds

With --repeats R the engines run in R rounds (every method once per round, so slow drift of the
machine hits all methods alike) and each (method, concurrency) reports the run with the median
tokens/s (the faster of two for R = 2); "runs" keeps every round's figures.

With several budgets the DDTree engines are listed side by side as methods "ddtree-b8",
"ddtree-b16", ... (one budget: method "ddtree"). The JSON starts with a "summary" table (tok/s, τ,
ratio to DFlash per method and concurrency); "methods" holds the full rows with token ids.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu",
             "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


def spec_config(method: str, drafter: str, budget: int, block: int):
    if method == "none":
        return None
    if method == "dflash":
        return {"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1}
    return {"method": "ddtree", "model": drafter, "budget": budget}


def expand_methods(methods: list[str], budgets: list[int]) -> list[tuple[str, str, int]]:
    """(name, method, budget) per engine: "ddtree" becomes one engine per budget."""
    out = []
    for m in methods:
        if m == "ddtree" and len(budgets) > 1:
            out += [(f"ddtree-b{b}", m, b) for b in budgets]
        else:
            out.append((m, m, budgets[0]))
    return out


def counters(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_draft_tokens")}


def child(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    from ddtree.bench.eval_drafter import eval_conversations

    llm = LLM(job["target"], speculative_config=job["spec"], enforce_eager=True, dtype="float32",
              max_model_len=2048, max_num_seqs=max(job["concurrency"]), seed=0, disable_log_stats=False,
              enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    convs = eval_conversations()["humaneval"][: job["num_prompts"]]
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    rows = []
    for c in job["concurrency"]:
        before = counters(llm)
        start = time.perf_counter()
        if c == 1:
            outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                    - before.get("vllm:spec_decode_num_accepted_tokens", 0))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"concurrency": c, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
                     "verify_steps": drafts, "tau": 1 + accepted / drafts if drafts else 1.0,
                     "draft_tokens": after.get("vllm:spec_decode_num_draft_tokens", 0)
                     - before.get("vllm:spec_decode_num_draft_tokens", 0),
                     "token_ids": [list(o.outputs[0].token_ids) for o in outs]})
    return {"rows": rows}


def run_child(job: dict, threads: int) -> dict:
    env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{job['method']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    concurrency = results["meta"]["concurrency"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        rows = results["methods"][m]
        xs = [j + i * width for j in range(len(concurrency))]
        axes[0].bar(xs, [r["tokens_per_s"] for r in rows], width, label=m)
        axes[1].bar(xs, [r["tau"] for r in rows], width, label=m)
    for ax, title in zip(axes, ("output tokens/s (aggregate)", "τ (tokens per verify step, bonus incl.)")):
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(concurrency))])
        ax.set_xticklabels([f"c={c}" for c in concurrency])
        ax.set_title(title)
        ax.legend()
    meta = results["meta"]
    fig.suptitle(f"vLLM {meta['vllm']} CPU ({meta['threads']} threads), SmolLM2-135M fp32, HumanEval "
                 f"{meta['num_prompts']} prompts x {meta['max_tokens']} tokens, greedy, DDTree budget "
                 f"{meta['budget']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,dflash,ddtree")
    p.add_argument("--budget", default="16", help="tree budget(s), comma-separated: 8,16,32")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds of all methods (median run reported; the faster of two)")
    p.add_argument("--out", default=str(RESULTS / "vllm_plugin_cpu.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    from ddtree.vllm import default_paths
    from ddtree.vllm.version import installed_vllm

    target, drafter = (str(x) for x in default_paths())
    block = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in str(args.budget).split(",")]
    results = {"meta": {"vllm": "==".join(installed_vllm()), "target": target, "drafter": drafter,
                        "budget": budgets[0] if len(budgets) == 1 else budgets,
                        "dflash_draft_tokens": block - 1, "num_prompts": args.num_prompts,
                        "max_tokens": args.max_tokens, "concurrency": concurrency, "threads": args.threads,
                        "dataset": "humaneval", "temperature": 0.0, "dtype": "float32", "enforce_eager": True,
                        "repeats": args.repeats},
               "summary": [], "methods": {}, "runs": {}}
    engines = expand_methods(args.methods.split(","), budgets)
    for _ in range(args.repeats):
        for name, method, budget in engines:
            job = {"method": method, "target": target, "spec": spec_config(method, drafter, budget, block),
                   "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "concurrency": concurrency}
            rows = run_child(job, args.threads)["rows"]
            results["runs"].setdefault(name, []).append(
                [{k: r[k] for k in ("concurrency", "tokens_per_s", "tau", "wall_s")} for r in rows])
            for r in rows:
                print(f"{name:10s} c={r['concurrency']}: {r['tokens_per_s']:6.2f} tok/s  tau {r['tau']:.2f}  "
                      f"({r['output_tokens']} tokens, {r['wall_s']:.1f} s)", flush=True)
            kept = results["methods"].setdefault(name, [[] for _ in rows])
            for i, r in enumerate(rows):
                kept[i].append(r)
    for name, per_c in results["methods"].items():  # the median run per concurrency
        results["methods"][name] = [sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for rs in per_c]
    base = results["methods"].get("none")
    if base:
        for method, rows in results["methods"].items():
            for r, b in zip(rows, base):
                r["same_tokens_as_no_spec"] = r["token_ids"] == b["token_ids"]
                r["speedup_vs_no_spec"] = r["tokens_per_s"] / b["tokens_per_s"]
    dflash = results["methods"].get("dflash")
    trees = [m for m in results["methods"] if m.startswith("ddtree")]
    if dflash and trees:
        ratios = {m: {f"c={a['concurrency']}": a["tokens_per_s"] / b["tokens_per_s"]
                      for a, b in zip(results["methods"][m], dflash)} for m in trees}
        results["ddtree_over_dflash"] = ratios["ddtree"] if trees == ["ddtree"] else ratios
        print("DDTree / DFlash tokens/s:", results["ddtree_over_dflash"])
    for method, rows in results["methods"].items():
        for i, r in enumerate(rows):
            row = {"method": method, "concurrency": r["concurrency"],
                   "tokens_per_s": round(r["tokens_per_s"], 2), "tau": round(r["tau"], 3),
                   "ms_per_step": round(1000 * r["wall_s"] / r["verify_steps"], 1) if r["verify_steps"] else None}
            if dflash and method.startswith("ddtree"):
                row["over_dflash"] = round(r["tokens_per_s"] / dflash[i]["tokens_per_s"], 3)
            if "same_tokens_as_no_spec" in r:
                row["same_tokens_as_no_spec"] = r["same_tokens_as_no_spec"]
            results["summary"].append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
