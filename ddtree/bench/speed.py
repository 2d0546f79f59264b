"""``ddtree bench``: AR, DFlash chain and DDTree side by side in one run, over the same prompts and
max_tokens, at several concurrency levels and temperatures. Reports tokens/s (aggregate and per
request), tau, speedup over AR and the step-time split (draft / build / verify / accept / commit /
prefill). Writes JSON and a PNG. ``--quick`` runs on a CPU in well under a minute (for CI).

Concurrency c is closed-loop: c requests in flight, a new one joins when one finishes. One engine
serves every method through per-request overrides, so all methods share weights and caches.

Output lengths: by default request i asks for a length drawn uniformly from [max_tokens / 2,
3 * max_tokens / 2] (seeded by i, the same for every method; EOS ignored so the token count is
fixed; with ``--stop-at-eos`` a request also ends at EOS, as in `ddtree eval-drafter`: after EOS
the target writes text the drafter never trained on, and tau drops) and a run at concurrency c
serves max(32, 4c) requests (prompts reused in order when a dataset has fewer). With one length
for every request (``--fixed-lengths``, the protocol before), plain decoding runs in lockstep: a whole batch finishes in the same step and the next one joins in one
batched prefill, while speculative methods finish requests at different steps, so requests join
one by one and the run ends in a tail of small batches. Real traffic has mixed lengths; the
fixed protocol charged that artifact to speculation (in the H200 trace of 2026-11-30, auto's
full-batch steps ran at 0.98-1.1x plain decoding's rate while whole runs came out at 0.71-0.95x)."""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from ddtree.engine.runner import GRAPH_BUCKETS
from ddtree.engine.sampling_params import SamplingParams


def parse_methods(text: str) -> list[tuple[str, int | str]]:
    out = []
    for item in text.split(","):
        name, _, budget = item.strip().partition(":")
        if name == "auto":  # auto:M = auto with ar_margin M (a side-by-side of policies)
            if budget:
                float(budget)
            out.append(("ddtree", f"auto:{budget}" if budget else "auto"))
            continue
        if name not in ("ar", "dflash", "ddtree"):
            raise ValueError(f"--methods: unknown method {name!r} (ar, dflash, ddtree:B, auto)")
        if name == "ddtree" and not budget.isdigit():
            raise ValueError(f"--methods: ddtree needs a budget, e.g. ddtree:32 (got {item!r})")
        out.append((name, int(budget) if name == "ddtree" else 0))
    return out


def is_auto(budget) -> bool:
    return isinstance(budget, str) and budget.startswith("auto")


def label(method: str, budget) -> str:
    if is_auto(budget):
        return "auto" if budget == "auto" else f"auto m={budget[5:]}"
    return method if method != "ddtree" else f"ddtree B={budget}"


def request_lengths(max_tokens: int, count: int, fixed: bool) -> list[int]:
    """Output length of request i of a run (see the module docstring)."""
    if fixed:
        return [max_tokens] * count
    import random
    lo, hi = max(1, max_tokens // 2), max(1, (3 * max_tokens) // 2)
    return [random.Random(i).randint(lo, hi) for i in range(count)]


def run_closed_loop(llm, prompt_ids, method, budget, temperature, max_tokens, concurrency,
                    stop_at_eos: bool = False) -> dict:
    """max_tokens: one length for every request, or a list (request i gets max_tokens[i]), its
    exact length unless stop_at_eos (then a request also ends at the target's EOS)."""
    budget = "auto" if is_auto(budget) else budget
    engine = llm.engine
    runner = engine.runner
    runner.settle_prefill_spans()
    runner.timer.totals.clear()
    runner.stage_seconds.clear()
    calls0, joins0 = runner.decode_calls, engine.scheduler.joins
    held0, dropped0 = engine.held_rounds, engine.dropped_rounds
    engine.step_choices.clear()
    if engine.auto_trace is not None:
        engine.auto_trace = []
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
    pending = list(zip(prompt_ids, lengths))
    in_flight, done = [], []
    captured0 = runner.num_captured
    pauses, began = [], [0.0]  # (generation, seconds) of each garbage collection during the run

    def on_gc(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)
    try:
        start = time.perf_counter()
        started, first = {}, {}
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                ids, length = pending.pop(0)
                params = SamplingParams(temperature=temperature, max_tokens=length, ignore_eos=not stop_at_eos)
                seq = engine.add_request(ids, params, method=method, budget=budget)
                started[seq.seq_id] = time.perf_counter()
                in_flight.append(seq)
            engine.step()
            now = time.perf_counter()
            for seq in in_flight:
                if seq.seq_id not in first and seq.num_output_tokens:
                    first[seq.seq_id] = (now, seq.num_output_tokens)
            for seq in [s for s in in_flight if s.is_finished]:
                in_flight.remove(seq)
                done.append((seq, now - started[seq.seq_id]))
        if engine.runner.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        gc.callbacks.remove(on_gc)
    tokens = sum(s.num_output_tokens for s, _ in done)
    lengths = [n for s, _ in done for n in s.metrics.accepted_lengths]
    runner.settle_prefill_spans()
    split = {**runner.timer.totals, **runner.stage_seconds}
    split["other"] = max(0.0, wall - sum(split.values()))  # host: scheduling, inputs, bookkeeping
    # Decode speed of a request after its first step (prefill and first token excluded), like
    # 1 / time-per-output-token.
    decode = [(s.num_output_tokens - first[s.seq_id][1]) / (started[s.seq_id] + t - first[s.seq_id][0])
              for s, t in done if s.num_output_tokens > first[s.seq_id][1]]
    ttft = sorted(first[s.seq_id][0] - started[s.seq_id] for s, _ in done)
    trace = {}
    if engine.auto_trace:
        trace["auto_trace"] = [{**e, "t": e["t"] - start} for e in engine.auto_trace]
    return {**trace, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "per_request_tokens_per_s": statistics.median(s.num_output_tokens / t for s, t in done),
            "per_request_decode_tokens_per_s": statistics.median(decode) if decode else None,
            "tau": sum(lengths) / len(lengths), "verify_steps": len(lengths),
            "engine_decode_steps": runner.decode_calls - calls0, "joins": engine.scheduler.joins - joins0,
            # what can stall a run besides the engine: garbage collections (full passes: generation
            # 2) and graphs captured mid-run; frozen_objects: the heap the collector skips (frozen_heap)
            "gc_s": sum(t for _, t in pauses), "gc_full_passes": sum(g == 2 for g, _ in pauses),
            "frozen_objects": gc.get_freeze_count(), "graphs_captured": runner.num_captured - captured0,
            # rounds not launched behind an unread one as the batch probably ended in it, and
            # rounds launched so and then dropped (every sequence had ended)
            "held_rounds": engine.held_rounds - held0, "dropped_rounds": engine.dropped_rounds - dropped0,
            # time to first token: queueing + prefill + first round (joins wait, see Scheduler)
            "ttft_s_p50": ttft[len(ttft) // 2], "ttft_s_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "split_s": split, "auto_choices": {f"{m}:{b}": k for (m, b), k in engine.step_choices.items()}}


def warm_up(llm, batch, method, budget, temperature, c, lengths, stop_at_eos: bool = False) -> None:
    """Kernels and a CUDA-graph capture for every batch bucket up to c (a run drains through the
    smaller ones: a capture inside a timed run costs more than the run). ``auto`` has every graph
    from its start-up profile; it warms up on one run of the cell's own requests (``batch``,
    ``lengths``) and keeps what it learned in earlier cells, as a server keeps it across changes
    of load. Short warm-up requests taught it the start of responses, the most predictable part:
    in an H200 trace at concurrency 64 it then ran 65 8-node-tree rounds at an estimated tau of
    2.7-2.9 where they accepted 2.44 (plain decoding was 10 % faster). Dropping its statistics at
    each cell instead left the rarely run trees with tau from their first tries only (also at
    the start of responses): auto fell to 0.95x plain decoding at concurrency 64 on HumanEval."""
    if is_auto(budget) and (llm.engine.auto.prior or not llm.engine.runner.use_graphs):
        run_closed_loop(llm, batch, method, budget, temperature, lengths, c, stop_at_eos)
        return
    graphs = llm.engine.runner.use_graphs
    # Every graph the runs may replay (longer sequences than the warm-up's cross key bounds)
    llm.engine.capture_graphs([(method, budget, False)], ("greedy" if temperature <= 0 else "sample",), c)
    for b in [b for b in GRAPH_BUCKETS if b < c and graphs] + [c]:
        run_closed_loop(llm, batch[:b], method, budget, temperature, 4 if b < c else 16, b)
    if is_auto(budget):
        run_closed_loop(llm, batch, method, budget, temperature, lengths, c, stop_at_eos)


def bench(llm, prompts: dict[str, list[list[int]]], methods, concurrency, temperatures, max_tokens,
          repeats: int, per_run=lambda c: max(8, 4 * c), on_row=None, fixed_lengths: bool = False,
          join_waits: list[int] | None = None, stop_at_eos: bool = False) -> list[dict]:
    """per_run(c): requests in one closed-loop run at concurrency c (prompts reused in order when
    there are fewer); on_row(rows) after each row (the CLI saves partial results, so a cut-off run
    still leaves data). join_waits: values of the scheduler's ``join_wait_rounds`` to run every
    method with, side by side (default: the engine's)."""
    rows = []
    default_margin = llm.engine.auto.ar_margin
    scheduler = llm.engine.scheduler
    join_waits = join_waits or [scheduler.join_wait_rounds]
    for name, ids in prompts.items():
        for t in temperatures:
            for c in concurrency:
                for wait in join_waits:  # side by side: each value runs every method
                    scheduler.join_wait_rounds = wait
                    for method, budget in methods:
                        if is_auto(budget):  # the engine's budget is "auto"; a margin is auto's state
                            llm.engine.auto.ar_margin = float(budget[5:]) if budget != "auto" else default_margin
                        count = max(per_run(c), c)
                        batch = [ids[i % len(ids)] for i in range(count)]
                        lengths = request_lengths(max_tokens, count, fixed_lengths)
                        warm_up(llm, batch, method, budget, t, c, lengths, stop_at_eos)  # then repeats; median reported
                        runs = []
                        for _ in range(repeats):  # each from an empty young heap: no run inherits
                            gc.collect()          # the garbage of the ones before
                            runs.append(run_closed_loop(llm, batch, method, budget, t, lengths, c, stop_at_eos))
                        best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
                        # One more run with per-stage graphs and events (fixed methods: auto's steps are
                        # the fixed methods' steps, and its per-stage graphs would be captured mid-run).
                        if llm.engine.runner.use_graphs and not is_auto(budget):
                            llm.engine.runner.profile_stages = True
                            for b in [b for b in GRAPH_BUCKETS if b < c] + [c]:  # captures
                                run_closed_loop(llm, ids[:b], method, budget, t, 4, b)
                            prof = run_closed_loop(llm, batch, method, budget, t, lengths, c, stop_at_eos)
                            best["split_s"], best["split_steps"] = prof["split_s"], prof["engine_decode_steps"]
                            llm.engine.runner.profile_stages = False
                        row = {"dataset": name, "temperature": t, "concurrency": c, "method": method,
                               "budget": budget, "join_wait_rounds": wait, "repeats": repeats,
                               "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
                               "gc_s_runs": [r["gc_s"] for r in runs],
                               "graphs_captured_runs": [r["graphs_captured"] for r in runs], **best}
                        if row.pop("auto_trace", None) is not None:  # every repeat's rounds, not only the
                            # reported one's: a slow repeat is the one to read
                            row["auto_trace_runs"] = [{"wall_s": r["wall_s"], "auto_trace": r.pop("auto_trace", [])}
                                                      for r in runs]
                        rows.append(row)
                        if on_row:
                            on_row(rows)
                        tag = f"{label(method, budget)}{f' w={wait}' if len(join_waits) > 1 else ''}"
                        print(f"{name:9s} T={t:g} c={c:3d} {tag:13s} {row['tokens_per_s']:9.1f} tok/s "
                              f"(decode/request {row['per_request_decode_tokens_per_s'] or 0:7.1f}, "
                              f"TTFT p50 {row['ttft_s_p50'] * 1e3:.1f} ms) tau={row['tau']:.2f} "
                              f"{row['auto_choices'] if is_auto(budget) else ''}", flush=True)
                    ar = next((r for r in rows[-len(methods):] if r["method"] == "ar"), None)
                    for r in rows[-len(methods):]:
                        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
    scheduler.join_wait_rounds = join_waits[0]
    return rows


def plot(rows: list[dict], png: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = (rows[0]["dataset"], rows[0]["temperature"])
    waits = list(dict.fromkeys(r.get("join_wait_rounds") for r in rows))
    # A side-by-side of join waits: plot the first value only (the others are in the JSON).
    sel = [r for r in rows if (r["dataset"], r["temperature"]) == first and r.get("join_wait_rounds") == waits[0]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for lab in dict.fromkeys(label(r["method"], r["budget"]) for r in sel):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in sel if label(r["method"], r["budget"]) == lab)
        axes[0].plot([c for c, _ in pts], [v for _, v in pts], "o-", label=lab)
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title=f"{first[0]} T={first[1]:g}")
    axes[0].legend()
    c0 = min(r["concurrency"] for r in sel)
    tree = sorted((r["budget"], r["tau"], r["speedup_vs_ar"] or 0) for r in sel
                  if r["method"] == "ddtree" and not is_auto(r["budget"]) and r["concurrency"] == c0)
    if tree:
        axes[1].plot([b for b, _, _ in tree], [t for _, t, _ in tree], "o-", label="tau")
        axes[1].plot([b for b, _, _ in tree], [s for _, _, s in tree], "s--", label="speedup vs AR")
        axes[1].set(xscale="log", xlabel="budget", title=f"DDTree at concurrency {c0}")
        axes[1].legend()
    stages = ["prefill", "draft", "build", "verify", "accept", "commit", "context", "other"]
    bars = [r for r in sel if r["concurrency"] == c0 and (r.get("split_steps") or not r.get("auto_choices"))]
    bottom = [0.0] * len(bars)
    for st in stages:
        vals = [r["split_s"].get(st, 0.0) / max(1, r.get("split_steps", r["engine_decode_steps"])) * 1e3
                for r in bars]
        axes[2].bar(range(len(bars)), vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set_xticks(range(len(bars)), [label(r["method"], r["budget"]) for r in bars], rotation=30)
    axes[2].set(ylabel="ms per engine step", title=f"step-time split, concurrency {c0}")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    from ddtree import LLM
    from ddtree.engine.args import add_engine_args
    from ddtree.engine.llm import frozen_heap

    p = argparse.ArgumentParser(prog="ddtree bench", description=__doc__)
    add_engine_args(p)
    p.add_argument("--methods", default="ar,dflash,ddtree:15,ddtree:31,ddtree:63,ddtree:127,auto")  # auto's budgets
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per dataset (default: all); a run at concurrency c serves max(--min-requests, 4c) requests")
    # 8 requests at c=1 (the default until 2026-12-01) were HumanEval's first 8 prompts: DDTree
    # B=32 accepted 2.63 tokens per round on them against 2.87 over all 164 (eval-drafter).
    p.add_argument("--min-requests", type=int, default=32, help="requests per run at low concurrency")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="mean output length (lengths uniform in [max/2, 3max/2]; see --fixed-lengths)")
    p.add_argument("--fixed-lengths", action="store_true", help="every request asks for exactly --max-tokens")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="a request also ends at the target's EOS (default: EOS ignored, every request makes its "
                        "length); at T=0 every method still makes the same tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts-json", default=None, help="exported eval prompts (ddtree eval-drafter --export-prompts)")
    p.add_argument("--auto-margin", type=float, default=None,
                   help="auto runs speculation only when its rate beats plain decoding's by this fraction")
    p.add_argument("--auto-trace", action="store_true",
                   help="keep every round of every method (method, wall time, tokens; auto's estimates every 16 rounds) in the JSON")
    p.add_argument("--join-waits", default=None,
                   help="comma-separated join_wait_rounds values to run every cell with, side by side "
                        "(default: --join-wait-rounds)")
    p.add_argument("--quick", action="store_true", help="tiny CPU run for CI: seconds, not minutes")
    p.add_argument("--out", default="bench/results/bench.json")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    if args.min_requests < 1:
        p.error(f"--min-requests must be at least 1, got {args.min_requests}")
    try:
        join_waits = [int(w) for w in args.join_waits.split(",")] if args.join_waits else None
    except ValueError:
        join_waits = [-1]
    if join_waits and min(join_waits) < 0:
        p.error(f"--join-waits must be integers >= 0, got {args.join_waits!r}")
    if args.quick:
        args.device = args.device or "cpu"
        args.methods, args.concurrency, args.temperatures = "ar,dflash,ddtree:8,auto", "1,2", "0"
        args.datasets, args.num_prompts, args.max_tokens, args.repeats = "mtbench", 2, 8, 1
        args.fixed_lengths = True
        args.max_budget = 8
    methods = parse_methods(args.methods)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    fixed = [b for _, b in methods if not is_auto(b)]
    cap = max(fixed + [args.max_budget])
    llm = LLM(target=args.target, drafter=args.drafter, method="ddtree", budget="auto", max_budget=cap,
              device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=max(concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_gb=args.kv_cache_gb, cuda_graphs=not args.no_cuda_graphs,
              overlap_steps=False if args.no_overlap_steps else None, join_wait_rounds=args.join_wait_rounds)
    if args.auto_margin is not None:
        llm.engine.auto.ar_margin = args.auto_margin
    if args.auto_trace:
        llm.engine.auto_trace = []
    t0 = time.perf_counter()
    prior = llm.engine.profile_auto(modes=sorted({"greedy" if t <= 0 else "sample" for t in temps}))
    if prior:
        print(f"auto: start-up cost curve for {len(prior)} (bucket, candidate) pairs in {time.perf_counter() - t0:.1f} s")
    if args.prompts_json:
        convs = json.loads(Path(args.prompts_json).read_text())
    else:
        from ddtree.bench.eval_drafter import eval_conversations
        convs = eval_conversations()
    per_run = lambda c: min(args.num_prompts or 10**9, max(args.min_requests, 4 * c))  # noqa: E731
    n = max(per_run(c) for c in concurrency)
    prompts = {d: llm.apply_chat_templates(convs[d][:n]) for d in args.datasets.split(",")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": str(llm.device), "dtype": str(llm.dtype), "target": str(llm.target_dir),
            "max_tokens": args.max_tokens, "fixed_lengths": args.fixed_lengths, "stop_at_eos": args.stop_at_eos,
            "requests_per_run": {c: per_run(c) for c in concurrency}, "quick": args.quick,
            "cuda_graphs": llm.engine.runner.use_graphs, "auto_ar_margin": llm.engine.auto.ar_margin,
            "auto_cost_prior_s": {f"{b}:{m}:{k}": v for (b, (m, k)), v in prior.items()}}
    if llm.device.type == "cuda":
        import torch
        meta["gpu"] = torch.cuda.get_device_name()
    save = lambda rows: out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))  # noqa: E731
    with frozen_heap():  # as a server runs: start-up objects out of the collector's full passes
        rows = bench(llm, prompts, methods, concurrency, temps, args.max_tokens, args.repeats,
                     per_run=per_run, on_row=save, fixed_lengths=args.fixed_lengths, join_waits=join_waits,
                     stop_at_eos=args.stop_at_eos)
    save(rows)
    plot(rows, args.png or out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0
