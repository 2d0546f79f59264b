"""`ddtree bench --quick`: the side-by-side speed harness runs on CPU and writes JSON + PNG."""
import gc
import json

import pytest

from ddtree import SamplingParams
from ddtree.bench.speed import main, parse_methods, request_lengths, run_closed_loop
from ddtree.engine.auto_budget import auto_candidates

from conftest import make_llm


def test_parse_methods():
    assert parse_methods("ar,dflash,ddtree:16,auto,auto:0.1") == [("ar", 0), ("dflash", 0), ("ddtree", 16),
                                                                   ("ddtree", "auto"), ("ddtree", "auto:0.1")]
    with pytest.raises(ValueError):
        parse_methods("auto:x")
    with pytest.raises(ValueError, match="budget"):
        parse_methods("ddtree")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("medusa")


def test_request_lengths_are_mixed_and_the_same_for_every_method():
    lengths = request_lengths(128, 256, fixed=False)
    assert lengths == request_lengths(128, 256, fixed=False)  # seeded: every method gets these
    assert min(lengths) >= 64 and max(lengths) <= 192 and len(set(lengths)) > 50
    assert abs(sum(lengths) / len(lengths) - 128) < 8
    assert request_lengths(128, 3, fixed=True) == [128, 128, 128]


def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--auto-trace", "--out", str(out)]) == 0
    assert gc.get_freeze_count() == 0  # the heap frozen for the runs is unfrozen after them
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["method"], r["budget"], r["concurrency"]) for r in rows} == {
        (m, b, c) for m, b in [("ar", 0), ("dflash", 0), ("ddtree", 8), ("ddtree", "auto")] for c in (1, 2)}
    for r in rows:
        assert r["tokens"] == 2 * 8 and r["tokens_per_s"] > 0 and r["tau"] >= 1.0
        # runs see a frozen start-up heap (models, modules: far more than 10k objects), and each
        # run's collector pauses and mid-run captures are kept
        assert r["frozen_objects"] > 10_000 and len(r["gc_s_runs"]) == len(r["graphs_captured_runs"]) == r["repeats"]
        assert r["gc_s"] >= 0 and r["graphs_captured"] == 0
        assert r["split_s"]["verify"] > 0
        # --auto-trace keeps every round of every method (for plain decoding too, to compare)
        assert len(r["auto_trace_runs"]) == r["repeats"] and "auto_trace" not in r  # each repeat's, once
        cands = {e["cand"] for t in r["auto_trace_runs"] for e in t["auto_trace"]}
        assert cands == {f"{r['method']}:{r['budget']}"} if r["budget"] != "auto" else cands <= set(r["auto_choices"])
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == 1.0 and r["tau"] == 1.0
        elif r["budget"] == "auto":  # every step of an auto run is one of its candidates
            assert sum(r["auto_choices"].values()) == r["engine_decode_steps"] > 0
            # --quick caps budgets at 8: auto's trees are 7 nodes (8 is one node above a candidate)
            assert set(r["auto_choices"]) <= {f"{m}:{b}" for m, b in auto_candidates(8, True)} == {
                "ar:0", "dflash:0", "ddtree:7"}
        else:
            assert r["split_s"]["draft"] > 0
    assert data["meta"]["device"] == "cpu"
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_projection_reuses_step_costs_with_a_new_tau_curve(tmp_path):
    """``--costs-from``: an earlier projection's measured step costs x a new acceptance curve."""
    from ddtree.bench import projection
    rows = [{"batch_size": n, "method": m, "budget": b, "step_s": s}
            for n, m, b, s in [(1, "ar", 0, 0.010), (1, "dflash", 0, 0.013), (1, "ddtree", 32, 0.016),
                               (64, "ar", 0, 0.020), (64, "dflash", 0, 0.080), (64, "ddtree", 32, 0.200)]]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"gpu": "NVIDIA H200", "drafter_layers": 5, "context": 1024, "rows": rows}))
    tau = tmp_path / "tau.json"
    tau.write_text(json.dumps({"results": [
        {"dataset": "humaneval", "temperature": 0.0, "method": "dflash", "budget": 0, "tau": 1.8},
        {"dataset": "humaneval", "temperature": 0.0, "method": "ddtree", "budget": 32, "tau": 2.4},
        {"dataset": "humaneval", "temperature": 1.0, "method": "ddtree", "budget": 32, "tau": 9.9}]}))
    out = tmp_path / "proj.json"
    assert projection.main(["--costs-from", str(earlier), "--tau-json", str(tau), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    speed = {(r["batch_size"], r["method"], r["budget"]): r["projected_speedup_vs_ar"] for r in got["rows"]}
    assert speed[(1, "dflash", 0)] == pytest.approx(1.8 * 0.010 / 0.013)
    assert speed[(1, "ddtree", 32)] == pytest.approx(2.4 * 0.010 / 0.016)
    assert speed[(64, "ddtree", 32)] == pytest.approx(2.4 * 0.020 / 0.200)
    assert got["best_per_batch_size"] == {"1": ["ddtree", 32, pytest.approx(1.5)], "64": ["ar", 0, 1.0]}
    assert got["gpu"] == "NVIDIA H200" and out.with_suffix(".png").exists()


def test_trace_summary_splits_full_fresh_tail_and_gaps():
    from ddtree.bench.trace import summarize
    trace = [{"n": 4, "cand": "ar:0", "s": 0.002, "tau": 1.0, "after": False},
             {"n": 4, "cand": "ar:0", "s": 0.001, "tau": 1.0, "after": True},
             {"n": 4, "cand": "ddtree:8", "s": 0.003, "tau": 2.0, "after": True},
             {"n": 2, "cand": "ar:0", "s": 0.001, "tau": 1.0, "after": False},
             {"n": 2, "cand": "ar:0", "s": None, "tau": 1.0, "after": False}]  # a capture: no cost
    got = summarize({"concurrency": 4, "wall_s": 0.010, "auto_trace": trace})
    assert got["full_rounds"] == 3 and got["tail_rounds"] == 1
    assert got["full_fresh_ms"] == 2.0 and got["full_overlapped_ms"] == 2.0  # median of 1 and 3 ms
    assert got["full_tokens_per_ms"] == round((4 + 4 + 8) / 6.0, 2)
    assert got["tail_tokens_per_ms"] == 2.0
    assert got["between_rounds_s"] == round(0.010 - 0.007, 4)


def test_bench_rejects_a_bad_min_requests(capsys):
    import pytest

    from ddtree.bench.speed import main
    with pytest.raises(SystemExit):
        main(["--min-requests", "0"])
    assert "--min-requests must be at least 1, got 0" in capsys.readouterr().err


def test_stop_at_eos_ends_requests_at_eos_and_the_default_ignores_it(smol, tokenizer, prompts):
    """The grid ignores EOS (every request makes its length) unless --stop-at-eos; with it a request
    ends at the target's EOS, and every method still makes the same tokens at T=0."""
    llm = make_llm(smol, tokenizer, method="ddtree", budget=8)
    engine = llm.engine
    first = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    engine.eos_token_ids = {first[4]}  # the fifth greedy token of prompt 0 stands in for EOS
    ignored = run_closed_loop(llm, prompts[:1], "ar", 0, 0.0, [12], 1)
    assert ignored["tokens"] == 12
    for method, budget in [("ar", 0), ("dflash", 0), ("ddtree", 8)]:
        stopped = run_closed_loop(llm, prompts[:1], method, budget, 0.0, [12], 1, stop_at_eos=True)
        assert stopped["tokens"] == first.index(first[4]) + 1, method  # EOS included, nothing after it


def test_bench_goals_reads_the_goal_ratios_from_a_grid(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    def row(method, budget, tps, c, tau=1.0, work=0.0):
        return {"dataset": "humaneval", "temperature": 0.0, "concurrency": c, "method": method, "budget": budget,
                "tokens_per_s": tps, "tau": tau, "split_s": {"build": work, "accept": 0.0, "commit": 0.0, "verify": 1.0 - work}}
    rows = [row("ar", 0, 1000.0, 1), row("dflash", 0, 2000.0, 1), row("ddtree", 63, 3100.0, 1, 4.0, 0.05),
            row("ddtree", "auto", 1900.0, 1),  # auto below the chain: 0.950
            row("ar", 0, 900.0, 4), row("dflash", 0, 1000.0, 4), row("ddtree", 63, 1200.0, 4, 3.0, 0.2),
            row("ddtree", "auto", 1100.0, 4)]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"meta": {}, "results": rows}))
    script = Path(__file__).parents[1] / "scripts" / "bench_goals.py"
    out = subprocess.run([sys.executable, script, grid], capture_output=True, text=True, check=True).stdout
    assert "garbage collection" not in out  # grids from before frozen_heap have no stall record
    rows[0] |= {"gc_s_runs": [0.002, 0.150], "graphs_captured_runs": [0, 0]}  # one run hit a full pass
    rows[1] |= {"gc_s_runs": [0.001, 0.001], "graphs_captured_runs": [1, 0]}  # one captured a graph
    grid.write_text(json.dumps({"meta": {}, "results": rows}))
    out = subprocess.run([sys.executable, script, grid], capture_output=True, text=True, check=True).stdout
    assert ("runs with >= 10 ms of garbage collection or a graph captured mid-run: 2/4 "
            "(collector at most 150.0 ms in a run, 1 captures)") in out
    assert "AR single stream >= 1,000 tok/s: 1,000-1,000 (1/1 cells)" in out
    assert "B=63 >= 1.3x chain at c=1: 1.55-1.55x (1/1 cells)" in out
    assert "B=63 >= 3.0x AR at c=1: 3.10-3.10x (1/1 cells)" in out
    assert "auto >= 1.0x best(AR, chain): 0.950-1.100x (1/2 cells)" in out
    assert "10 % of the B=63 round: 5.0-20.0 % (1/2 rows)" in out
    assert "| HumanEval T=0 c=4 | 900 | 1,000 | 1,200 | 1,100 | 1.100 | 1.20 | 1.33 | 3.00 |" in out
    # another auto policy side by side: its own line, and --auto makes its rows auto's
    rows += [row("ddtree", "auto:0.05", 2100.0, 1), row("ddtree", "auto:0.05", 990.0, 4)]
    grid.write_text(json.dumps({"meta": {}, "results": rows}))
    out = subprocess.run([sys.executable, script, grid], capture_output=True, text=True, check=True).stdout
    assert "auto >= 1.0x best(AR, chain): 0.950-1.100x (1/2 cells)" in out
    assert "auto:0.05 >= 1.0x best(AR, chain): 0.990-1.050x (1/2 cells)" in out
    out = subprocess.run([sys.executable, script, grid, "--auto", "auto:0.05"], capture_output=True,
                         text=True, check=True).stdout
    assert "auto >= 1.0x best(AR, chain): 0.990-1.050x (1/2 cells)" in out and "  auto >= 1.0x" in out
    for extra, error in [(row("ddtree", 31, 1.0, 4), "expected one DDTree budget per grid"),
                         (row("ar", 0, 1.0, 16), "cell ('humaneval', 0.0, 16) has no auto, ddtree, dflash row")]:
        grid.write_text(json.dumps({"meta": {}, "results": rows + [extra]}))
        failed = subprocess.run([sys.executable, script, grid], capture_output=True, text=True)
        assert failed.returncode != 0 and error in failed.stderr, failed.stderr


def test_trace_rounds_splits_a_run_into_overlapped_fresh_and_rest(tmp_path):
    import runpy
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "trace_rounds.py"
    split = runpy.run_path(str(script))["split"]
    trace = [{"t": 1.5, "s": 1.0, "after": False}, {"t": 2.5, "s": 1.0, "after": True},
             {"t": 3.5, "s": 1.0, "after": True}, {"t": 6.2, "s": 1.2, "after": False},  # a prefill before it
             {"t": 7.2, "s": 1.0, "after": True}]
    s = split(trace, 7.5)
    assert (s["rounds"], s["overlapped_rounds"]) == (5, 3)
    assert (round(s["overlapped_ms"], 6), round(s["fresh_ms"], 6), round(s["rest_ms"], 6)) == (3000.0, 2200.0, 2300.0)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"meta": {}, "results": [{"method": "ar", "budget": 0}]}))
    failed = subprocess.run([sys.executable, script, plain], capture_output=True, text=True)
    assert failed.returncode != 0 and "no auto_trace_runs" in failed.stderr
