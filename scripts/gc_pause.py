"""What a full garbage-collector pass costs the engine's process, with and without the start-up
heap frozen (``ddtree.engine.llm.frozen_heap``, which ``ddtree serve`` and ``ddtree bench`` run
under), and what the collector did during closed-loop runs of each method.

    python scripts/gc_pause.py --out bench/results/gc_pause_cpu.json            # CPU
    python scripts/gc_pause.py --target <gguf> --out gc_pause_h100.json         # on a GPU

A full pass runs when the young generations have been collected often enough and the objects
promoted since the last full pass exceed a quarter of the old heap, so it comes rarely and
lands on whichever run is going: the pause is what it costs that run.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path


def full_pass_seconds(reps: int = 3) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    from ddtree import LLM
    from ddtree.bench.eval_drafter import eval_conversations
    from ddtree.bench.speed import run_closed_loop
    from ddtree.engine.llm import frozen_heap

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts-json", default=None, help="exported eval prompts (as `ddtree bench` takes them)")
    p.add_argument("--out", default="bench/results/gc_pause_cpu.json")
    args = p.parse_args(argv)

    llm = LLM(target=args.target, device=args.device, budget="auto", max_budget=16,
              max_num_seqs=max(4, args.concurrency))
    if llm.engine.runner.use_graphs:
        llm.engine.profile_auto()  # as the server and the bench do: every graph captured first
    convs = json.loads(Path(args.prompts_json).read_text()) if args.prompts_json else eval_conversations()
    prompts = llm.apply_chat_templates(convs["mtbench"][:args.requests])
    methods = (("ar", 0), ("dflash", 0), ("ddtree", 16))

    def runs() -> list[dict]:
        out = []
        for method, budget in methods:
            before = [g["collections"] for g in gc.get_stats()]
            r = run_closed_loop(llm, prompts, method, budget, 0.0, args.max_tokens, args.concurrency)
            passes = [g["collections"] - b for g, b in zip(gc.get_stats(), before)]
            out.append({"method": method, "budget": budget, "wall_s": r["wall_s"], "steps": r["engine_decode_steps"],
                        "gc_s": r["gc_s"], "gc_full_passes": r["gc_full_passes"], "passes_per_generation": passes})
        return out

    runs()  # warm up
    gc.collect()
    result = {"device": str(llm.device), "cpu": platform.processor() or platform.machine(),
              "python": platform.python_version(), "tracked_objects": len(gc.get_objects()),
              "full_pass_s": full_pass_seconds(), "runs": runs()}
    with frozen_heap() as frozen:
        result.update(frozen_objects=frozen, full_pass_frozen_s=full_pass_seconds(), runs_frozen=runs())
    if llm.device.type == "cuda":
        import torch
        result["gpu"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    ms = lambda xs: "/".join(f"{x * 1e3:.2f}" for x in xs)  # noqa: E731
    print(f"{result['tracked_objects']} tracked objects; full pass {ms(result['full_pass_s'])} ms; "
          f"with {frozen} frozen: {ms(result['full_pass_frozen_s'])} ms")
    for label, rs in (("unfrozen", result["runs"]), ("frozen", result["runs_frozen"])):
        for r in rs:
            print(f"{label:8s} {r['method']:6s} {r['steps']:4d} steps {r['wall_s']:7.2f} s, "
                  f"collector {r['gc_s'] * 1e3:7.2f} ms (passes by generation {r['passes_per_generation']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
