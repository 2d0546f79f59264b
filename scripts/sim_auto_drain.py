"""Does auto's tau estimate get stuck across closed-loop runs when acceptance falls along each
response? (MT-Bench T=1 c=16 on the H200: two of four repeats decoded plainly at full batch while
trees were 1.14x faster; the drain at each run's end fills the tau window with low rounds.)

A simulation, CPU only: the H200 start-up cost curve (bench_h200_phase7.json), MT-Bench T=1 tau
per candidate at mixed positions, each sequence accepting (tau - 1) * factor(position) extra
tokens on average, closed loops of uniform 64-192-token requests with the controller kept across
runs, as in `ddtree bench`. It prints every fixed candidate's rate (tokens/ms) and auto's per
run. On 2026-12-04 it did not reproduce the stuck runs (auto 0.94-1.02x the best fixed candidate
at c=16), so it is not a test yet.

python scripts/sim_auto_drain.py
"""
import random
import statistics

from ddtree.engine.auto_budget import AutoBudget, auto_candidates

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
CANDS = auto_candidates(127, True)  # ar, chain, 7 ... 127 nodes
PRIOR_MS = {  # per bucket, in CANDS order
    1: [0.976, 1.272, 1.266, 1.31, 1.349, 1.39, 1.547], 2: [0.987, 1.308, 1.315, 1.366, 1.39, 1.528, 1.647],
    4: [1.007, 1.336, 1.329, 1.403, 1.516, 1.622, 1.937], 8: [1.005, 1.438, 1.439, 1.553, 1.632, 1.861, 2.247],
    16: [1.069, 1.59, 1.562, 1.687, 1.894, 2.191, 3.357], 24: [1.081, 1.785, 1.693, 1.903, 2.134, 2.915, 4.164],
    32: [1.114, 1.864, 1.738, 2.008, 2.295, 3.313, 5.23], 48: [1.209, 2.078, 1.941, 2.286, 3.069, 4.433, 7.367],
    64: [1.227, 2.234, 2.021, 2.485, 3.503, 5.158, 9.26]}
TAU = dict(zip(CANDS, (1.0, 1.39, 1.72, 1.88, 1.98, 2.05, 2.1)))


def bucket_of(n):
    return next(b for b in BUCKETS if b >= n)


def factor(position):  # acceptance falls along a response (1.3 at its start, 0.34 at token 192)
    return max(0.3, 1.3 - position / 200)


def simulate(c, requests, runs, seed, fixed=None):
    """Tokens/ms of each run after a warm-up run; ``fixed``: one candidate instead of auto."""
    rng = random.Random(seed)
    auto = AutoBudget(CANDS, bucket_of)
    auto.prior = {(b, cand): PRIOR_MS[b][i] * 1e-3 for b in BUCKETS for i, cand in enumerate(CANDS)}
    rates = []
    for r in range(runs + 1):
        pending = [random.Random(i).randint(64, 192) for i in range(requests)]
        live, seconds, tokens = [], 0.0, 0
        while pending or live:
            while pending and len(live) < c:
                live.append([0, pending.pop(0)])  # [position, length]
            n = len(live)
            cand = fixed or auto.choose(n)
            accepted = []
            for seq in live:
                keep = 1 - 1 / (1 + (TAU[cand] - 1) * factor(seq[0]))
                k = 1
                while k < 16 and rng.random() < keep:
                    k += 1
                k = min(k, seq[1] - seq[0])
                accepted.append(k)
                seq[0] += k
            step = PRIOR_MS[bucket_of(n)][CANDS.index(cand)] * rng.uniform(0.98, 1.04) * 1e-3
            if not fixed:
                auto.observe(n, cand, step, sum(accepted) / n)
            seconds, tokens = seconds + step, tokens + sum(accepted)
            live = [s for s in live if s[0] < s[1]]
        if r:
            rates.append(tokens / seconds / 1e3)
    return rates


if __name__ == "__main__":
    for c, requests in ((4, 32), (16, 64), (64, 256)):
        fixed = {f"{m}:{b}": statistics.mean(simulate(c, requests, 3, 0, fixed=(m, b))) for m, b in CANDS}
        print(f"c={c} fixed:", {k: round(v, 2) for k, v in fixed.items()})
        for seed in range(3):
            print("  auto per run:", [round(x, 2) for x in simulate(c, requests, 8, seed)])
