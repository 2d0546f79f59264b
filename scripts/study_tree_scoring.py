"""Study (not shipped): would a per-depth calibration of the drafter's log-probabilities build
better trees? Measured answer for the phase-4 drafter: no (README, "Tree scoring").

DDTree scores a prefix by the sum of the drafter's per-depth log-probabilities of its tokens, i.e.
it treats them as the chance that the target accepts each token. They are not calibrated: how
often the target agrees with a drafter token of log-probability x depends on the depth (the
drafter sees the target's features only up to the root). A per-depth map
f_d(x) = log sigmoid(a_d * x + c_d) (monotone, <= 0, so the top-B set stays a prefix-closed tree
and the builders' ordering rules hold) is fitted to the target's answers on recorded trees
(`scripts/device/record_trees.py`): label 1 when the node is the target's argmax given its path
(T=0) or the target's probability of the token (T=1), over nodes whose parent lies on the
target's path. Any tree is lossless; calibration only changes which tree is verified. The
oracle row scores nodes by the target's own answers (what no drafter-side score can beat).

python scripts/study_tree_scoring.py --records DIR --fit-sets train_t0 --out result.json
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch


def load_records(path: Path) -> dict[str, np.ndarray]:
    z = np.load(path)
    return {k: z[k] for k in z.files}


def path_sums(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per node the sum of ``values`` over its path (itself and its non-root ancestors).
    parent [R, n] holds tree indices (0 = root, p = node p-1); parents precede children."""
    out = np.zeros_like(values, dtype=np.float64)
    rows = np.arange(parent.shape[0])
    for i in range(parent.shape[1]):
        p = parent[:, i].astype(np.int64)
        out[:, i] = values[:, i] + np.where(p > 0, out[rows, np.maximum(p - 1, 0)], 0.0)
    return out


def on_path_parent(parent: np.ndarray, is_argmax: np.ndarray) -> np.ndarray:
    """Whether each node's parent is on the target's greedy path (the root always is)."""
    ok = path_sums(parent, (~is_argmax).astype(np.float64)) == 0  # node and ancestors all argmax
    rows = np.arange(parent.shape[0])[:, None]
    p = parent.astype(np.int64)
    return np.where(p > 0, ok[rows, np.maximum(p - 1, 0)], True)


def select(score: np.ndarray, depth: np.ndarray, budget: int) -> np.ndarray:
    """The top-``budget`` nodes per row by score (ties: smaller depth, then earlier node)."""
    n = score.shape[1]
    key = np.lexsort((np.broadcast_to(np.arange(n), score.shape), depth, -score), axis=1)
    sel = np.zeros(score.shape, dtype=bool)
    np.put_along_axis(sel, key[:, :budget], True, axis=1)
    return sel


def expected_tau(parent, selected, is_argmax, logp, temperature: float) -> float:
    """Mean accepted length (accepted nodes + the bonus token) of the selected trees: at T=0 the
    selected nodes whose whole path is the target's argmax; at T=1 the expected count, the sum
    over selected nodes of the product of the target's probabilities along the path."""
    if temperature == 0:
        hit = path_sums(parent, (~is_argmax).astype(np.float64)) == 0
        return float(1 + (hit & selected).sum(1).mean())
    reach = np.exp(path_sums(parent, logp.astype(np.float64)))
    return float(1 + (reach * selected).sum(1).mean())


def groups(s: dict, depths: int, split_chain: bool) -> np.ndarray:
    """Calibration group of every node: its depth - 1, plus ``depths`` when ``split_chain`` and
    some ancestor is not the drafter's first choice at its depth (off the drafter's chain)."""
    g = s["depth"].astype(np.int64) - 1
    if split_chain:
        off = (s["rank"] > 0).astype(np.float64)
        g = g + depths * ((path_sums(s["parent"], off) - off) > 0)
    return g


def calibrate(logq: np.ndarray, group: np.ndarray, table: np.ndarray | None) -> np.ndarray:
    """log sigmoid(a_g * logq + c_g) with table[g] = (a_g, c_g); the identity without a table."""
    if table is None:
        return logq.astype(np.float64)
    a, c = table[group, 0], table[group, 1]
    return -np.logaddexp(0.0, -(a * logq + c))


def fit_table(sets: list[dict], group_of, n_groups: int, steps: int = 200) -> np.ndarray:
    """Per-group (a, c) by maximum likelihood (binary cross-entropy with hard labels at T=0 and
    the target's probability as a soft label at T=1) over nodes whose parent is on the target's
    greedy path; groups with fewer than 50 such nodes keep (1, 8), close to the raw score."""
    xs, gs, ys = [], [], []
    for s in sets:
        keep = on_path_parent(s["parent"], s["is_argmax"])
        y = s["is_argmax"].astype(np.float64) if s["temperature"] == 0 else np.exp(s["logp"].astype(np.float64))
        xs.append(s["logq"][keep].astype(np.float64))
        gs.append(group_of(s)[keep])
        ys.append(y[keep])
    x, g, y = (torch.from_numpy(np.concatenate(v)) for v in (xs, gs, ys))
    table = np.tile(np.array([1.0, 8.0]), (n_groups, 1))
    for k in range(n_groups):
        m = g == k
        if int(m.sum()) < 50:
            continue
        params = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([params], max_iter=steps, line_search_fn="strong_wolfe")
        xk, yk = x[m], y[m]

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(params[0] * xk + params[1], yk)
            loss.backward()
            return loss

        opt.step(closure)
        a, c = params.detach().tolist()
        table[k] = (max(a, 1e-3), c)  # a > 0 keeps the map increasing
    return table


def read_sets(records: Path) -> dict[str, dict]:
    sets = {}
    for f in sorted(records.glob("trees_*.npz")):
        key = f.stem[len("trees_"):]
        s = load_records(f)
        s["temperature"] = float(key.rsplit("_t", 1)[1])
        sets[key] = s
    return sets


def evaluate(sets: dict[str, dict], table: np.ndarray | None, group_of, budgets: list[int]) -> dict:
    out = {}
    for key, s in sets.items():
        score = path_sums(s["parent"], calibrate(s["logq"], group_of(s), table))
        out[key] = {b: expected_tau(s["parent"], select(score, s["depth"], b), s["is_argmax"], s["logp"],
                                    s["temperature"]) for b in budgets}
    return out


def oracle_tau(s: dict, budgets: list[int]) -> dict:
    """Trees chosen with the target's answers: at T=0 nodes on the target's greedy path first, at
    T=1 by the target's path probability (within the recorded candidates)."""
    if s["temperature"] == 0:
        hit = path_sums(s["parent"], (~s["is_argmax"]).astype(np.float64)) == 0
        score = np.where(hit, 0.0, -1.0) + 1e-3 * path_sums(s["parent"], s["logq"].astype(np.float64))
    else:
        score = path_sums(s["parent"], s["logp"].astype(np.float64))
    return {b: expected_tau(s["parent"], select(score, s["depth"], b), s["is_argmax"], s["logp"], s["temperature"])
            for b in budgets}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python scripts/study_tree_scoring.py")
    p.add_argument("--records", type=Path, required=True, help="folder of record_trees.py's trees_*.npz")
    p.add_argument("--fit-sets", default="train_t0", help="comma-separated record sets to fit on")
    p.add_argument("--out", type=Path)
    p.add_argument("--budgets", default="4,8,16,32")
    args = p.parse_args(argv)
    sets = read_sets(args.records)
    budgets = [int(b) for b in args.budgets.split(",")]
    names = args.fit_sets.split(",")
    depths = int(max(s["depth"].max() for s in sets.values()))
    result = {"fitted_on": names, "tau_raw": evaluate(sets, None, lambda s: None, budgets),
              "tau_oracle": {k: oracle_tau(s, budgets) for k, s in sets.items()}}
    # By depth alone (what a builder could apply to its per-depth top-k), and by depth and whether
    # the node's ancestors are all the drafter's first choices (which a builder could not).
    for name, split in (("by_depth", False), ("by_depth_and_chain", True)):
        group_of = lambda s, split=split: groups(s, depths, split)  # noqa: E731
        table = fit_table([sets[k] for k in names], group_of, depths * (2 if split else 1))
        result[name] = {"table": table.tolist(), "tau": evaluate(sets, table, group_of, budgets)}
    base = result["tau_raw"]
    for key in sets:
        print(key, " ".join(f"B{b}: raw {base[key][b]:.3f}, by depth {result['by_depth']['tau'][key][b] / base[key][b]:.3f}x, "
                            f"+chain {result['by_depth_and_chain']['tau'][key][b] / base[key][b]:.3f}x, "
                            f"oracle {result['tau_oracle'][key][b]:.3f}" for b in budgets))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
