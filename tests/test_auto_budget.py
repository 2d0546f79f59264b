"""budget="auto": the controller's choices, and losslessness while steps switch methods."""
import itertools
import random
import statistics

from ddtree.engine.auto_budget import AutoBudget, Recent, auto_candidates
from ddtree import SamplingParams
from ddtree.engine.llm import SHIPPED_DRAFTERS

from conftest import GREEDY_64, make_llm

SHIPPED = SHIPPED_DRAFTERS / "SmolLM2-135M-Instruct-DFlash"


def run(controller, n, steps, tau, cost):
    seen = []
    for _ in range(steps):
        cand = controller.choose(n)
        seen.append(cand)
        controller.observe(n, cand, cost(n, cand), tau(cand))
    return seen


def run_fresh_every_fourth(controller, rounds, real, tau):
    """Batch-64 rounds, every fourth one fresh, each costing ``real[(cand, fresh)]``."""
    chosen = []
    for i in range(rounds):
        fresh = i % 4 == 0
        cand = controller.choose(64, fresh)
        controller.observe(64, cand, real[(cand, fresh)], tau[cand], fresh)
        chosen.append((fresh, cand))
    return chosen


def tree_tau(cand):
    return {"ar": 1.0, "dflash": 1.5}.get(cand[0], 1.6 + cand[1] / 200)


def test_candidates():
    # 2^k - 1 nodes (2^k verified tokens fill the kernels' tiles); the cap joins unless it is one above
    assert auto_candidates(64, has_drafter=True) == [("ar", 0), ("dflash", 0), ("ddtree", 7), ("ddtree", 15),
                                                     ("ddtree", 31), ("ddtree", 63)]
    assert auto_candidates(128, has_drafter=True)[-1] == ("ddtree", 127)
    assert auto_candidates(48, has_drafter=True)[-2:] == [("ddtree", 31), ("ddtree", 48)]
    assert auto_candidates(5, has_drafter=True)[-1] == ("ddtree", 5)
    assert auto_candidates(64, has_drafter=False) == [("ar", 0)]


def pow2_candidates(cap: int) -> list[tuple[str, int]]:
    """The power-of-two budgets the simulations below were written for (the controller does not
    care which budgets it is given)."""
    return auto_candidates(cap, True, budgets=(8, 16, 32, 64, 128))


def test_picks_trees_when_cheap_and_plain_decoding_under_load():
    controller = AutoBudget(pow2_candidates(64), bucket_of=lambda n: n)

    def cost(n, cand):  # verify cost grows with the tokens verified, steeply at large batches
        tokens = {"ar": 1, "dflash": 16}.get(cand[0], cand[1] + 1)
        return 1.0 + (0.002 if n == 1 else 0.05) * tokens * n

    run(controller, 1, 200, tree_tau, cost)
    assert controller.best(1) == ("ddtree", 64)
    run(controller, 32, 200, tree_tau, cost)
    assert controller.best(32) == ("ar", 0)
    late = run(controller, 32, 64, tree_tau, cost)
    assert late.count(("ar", 0)) >= 62  # explores rarely, and only plausible neighbours


def test_exploration_loses_at_most_its_budget_under_load():
    """Concurrency-64-like costs: a tree or chain round costs 3-10 plain rounds and is 0.67-0.88x
    as fast, so plain decoding is best. Exploring a plausible candidate every 32 steps lost ~1.7 %
    of the time; with the budget, explorations lose at most ~explore_budget, and still happen."""
    cost = {("ar", 0): 1.0, ("dflash", 0): 3.0, ("ddtree", 8): 3.3, ("ddtree", 16): 4.8,
            ("ddtree", 32): 6.3, ("ddtree", 64): 9.7}
    tau = {("ar", 0): 1.0, ("dflash", 0): 2.6, ("ddtree", 8): 2.9, ("ddtree", 16): 3.9,
           ("ddtree", 32): 4.2, ("ddtree", 64): 4.4}

    def loss(budget):
        controller = AutoBudget(list(cost), bucket_of=lambda n: n, explore_budget=budget)
        run(controller, 64, 200, tau.get, lambda n, c: cost[c])  # first tries
        seen = run(controller, 64, 4000, tau.get, lambda n, c: cost[c])
        lost = sum(cost[c] - tau[c] * cost[("ar", 0)] for c in seen)  # against plain decoding
        return lost / sum(cost[c] for c in seen), sum(c != ("ar", 0) for c in seen)

    unbudgeted, _ = loss(float("inf"))
    budgeted, explored = loss(0.005)
    assert unbudgeted > 0.012, unbudgeted
    assert budgeted <= 0.006, budgeted
    assert explored >= 10  # estimates are still refreshed


def test_explorations_pay_for_their_switch_from_plain_decoding():
    """H200 trace at concurrency 64, T=1 (MT-Bench): plain decoding is best, an 8-node tree nearly
    as fast per round (0.96x), but the plain round before each speculative one took ~0.5 ms more
    (the drafter's catch-up and the tree's preparation outlast its GPU time), so each exploration
    cost far more than its rate gap. Rounds are simulated as the engine reads them: a round's time
    is known after the next one is launched. Told of the switches, the controller keeps the whole
    loss within its exploration budget and still explores; not told, it loses several times that."""
    cost = {("ar", 0): 1.2, ("ddtree", 8): 2.0}
    tau = {("ar", 0): 1.0, ("ddtree", 8): 1.6}
    switch_cost = 0.5

    def loss(report_switches: bool):
        controller = AutoBudget(list(cost), bucket_of=lambda n: n)
        prev, spent, tokens, explored = None, 0.0, 0.0, 0
        for step in range(6000):
            cand = controller.choose(64)
            if prev is not None:
                switch = prev == ("ar", 0) and cand != ("ar", 0)
                seconds = cost[prev] + (switch_cost if switch else 0.0)
                controller.observe(64, prev, seconds, tau[prev], switch=switch and report_switches)
                if step > 200:
                    spent, tokens = spent + seconds, tokens + tau[prev]
                    explored += prev != ("ar", 0)
            prev = cand
        return spent / (tokens * cost[("ar", 0)]) - 1, explored

    told, explored = loss(True)
    untold, _ = loss(False)
    assert told <= 0.006 and explored >= 5, (told, explored)
    assert untold > 2 * told, (untold, told)
    assert untold > 0.008, untold


def test_plain_decoding_is_measured_when_every_plain_round_is_a_switch():
    """H200 trace at concurrency 64, T=1 (MT-Bench, bench_h200_trace_c64_join_wait.json.gz):
    plain decoding's estimate was stale at 1.54 ms (start-up curve plus an old overhead) against
    1.2 ms real, so an 8-node tree (2.0 ms, tau 1.6) won; each plain exploration was one round
    followed by a tree round, a switch, whose time is not plain decoding's cost, so the estimate
    never moved and auto ran 294 tree rounds at 0.95x plain decoding's speed. A plain exploration
    now runs two rounds (the first is measured) and a few rounds of its own may lower a
    candidate's estimate: the controller returns to plain decoding."""
    plain, tree = ("ar", 0), ("ddtree", 8)
    cost, tau, switch_cost = {plain: 1.2, tree: 2.0}, {plain: 1.0, tree: 1.6}, 0.6
    controller = AutoBudget([plain, tree], bucket_of=lambda n: n)
    controller.prior = {(64, plain): 1.0, (64, tree): 1.9}
    for _ in range(9):  # overhead of plain rounds measured under another load
        controller.overhead_samples.setdefault((64, False, True), Recent(9)).append(0.54)
    controller.tries = {plain: 4}
    for _ in range(4):
        controller.observe(64, tree, cost[tree], tau[tree])
    assert controller.best(64) == tree
    prev, spent, tokens, runs, back = None, 0.0, 0.0, {plain: 0, tree: 0}, None
    for step in range(3000):
        cand = controller.choose(64)
        if back is None and controller.best(64) == plain:
            back = step
        if prev is not None:
            switch = prev == plain and cand != plain
            seconds = cost[prev] + (switch_cost if switch else 0.0)
            controller.observe(64, prev, seconds, tau[prev], switch=switch)
            if step > 1000:
                spent, tokens = spent + seconds, tokens + tau[prev]
                runs[prev] += 1
        prev = cand
    # Back within 100 rounds (320 with only the two-round exploration: a whole run at c=64 is ~300).
    assert back is not None and back < 100, back
    assert controller.best(64) == plain
    assert runs[plain] > 0.9 * sum(runs.values()), runs
    assert spent / (tokens * cost[plain]) - 1 < 0.01


def test_a_stall_does_not_freeze_out_the_best_candidate():
    """A step that captured a graph is not timed, and one slow step (GC, another process)
    does not move the cost estimate (median of recent steps), so the best tree stays the choice."""
    controller = AutoBudget(pow2_candidates(16), bucket_of=lambda n: n)

    def cost(n, cand):
        return {"ar": 1.0, "dflash": 1.2}.get(cand[0], 1.2)

    run(controller, 1, 60, tree_tau, cost)
    best = controller.best(1)
    assert best == ("ddtree", 16)
    before = controller.step_cost(1, best)
    controller.observe(1, best, None, tree_tau(best))  # its wall time included a capture
    assert controller.step_cost(1, best) == before
    controller.observe(1, best, 50 * before, tree_tau(best))  # a 50x stall
    assert controller.step_cost(1, best) == before
    assert controller.best(1) == best


def test_costs_are_the_startup_curve_plus_measured_host_overhead():
    """Until a candidate has steps of its own, its cost is the start-up curve plus the host
    overhead measured on other rounds of its class: speculative rounds share theirs, plain
    decoding keeps its own."""
    controller = AutoBudget(pow2_candidates(16), bucket_of=lambda n: n)
    controller.prior = {(1, c): 1.0 + i / 10 for i, c in enumerate(controller.candidates)}
    chain, tree, plain = ("dflash", 0), ("ddtree", 16), ("ar", 0)
    for _ in range(5):
        controller.observe(1, chain, controller.prior[(1, chain)] + 0.25, 1.5)  # 0.25 of host work per step
    assert abs(controller.step_cost(1, tree) - (controller.prior[(1, tree)] + 0.25)) < 1e-9
    controller.observe(1, tree, 40.0, 2.0)  # a stall in one tree step
    assert abs(controller.step_cost(1, tree) - (controller.prior[(1, tree)] + 0.25)) < 1e-9
    assert controller.step_cost(1, plain) == controller.prior[(1, plain)]  # none of its class yet
    controller.observe(1, plain, controller.prior[(1, plain)] + 0.1, 1.0)
    assert abs(controller.step_cost(1, plain) - (controller.prior[(1, plain)] + 0.1)) < 1e-9


def test_overlapped_and_fresh_rounds_are_costed_apart():
    """Overlapped rounds cost their GPU time; fresh ones add the host's preparation. Plain
    decoding at 1.0 / 1.5 and a tree (tau 2.2) at 2.4 / 2.9: the tree is worth running only in
    fresh rounds (0.76 vs 0.67 tokens per unit; 0.92 vs 1.0 overlapped). Whatever the mix of the
    last rounds, each kind of round gets its own answer; one cost per candidate would follow the
    mix and choose the same for both."""
    controller = AutoBudget([("ar", 0), ("ddtree", 8)], bucket_of=lambda n: n, explore_every=10**9)
    cost = {(("ar", 0), False): 1.0, (("ar", 0), True): 1.5, (("ddtree", 8), False): 2.4,
            (("ddtree", 8), True): 2.9}
    rng = random.Random(0)
    for i in range(400):
        fresh = rng.random() < (0.8 if i < 200 else 0.2)  # the mix changes halfway
        cand = controller.choose(64, fresh)
        controller.observe(64, cand, cost[(cand, fresh)], 1.0 if cand == ("ar", 0) else 2.2, fresh)
        if i > 50:
            assert cand == (("ddtree", 8) if fresh else ("ar", 0)), (i, fresh, cand)


def test_plain_rounds_do_not_borrow_speculative_overhead():
    """H200 trace at concurrency 64: the tree's first rounds were fresh ones, whose overhead
    (wall - start-up curve) includes catching up deferred drafter context; plain decoding's
    first rounds were overlapped. Priced with the tree's fresh overhead, plain decoding looked
    slower than the tree in fresh rounds and was never tried there. Each class keeps its own
    overhead, so plain decoding is tried fresh, measured, and wins those rounds too."""
    controller = AutoBudget([("ar", 0), ("ddtree", 8)], bucket_of=lambda n: n, explore_every=10**9)
    controller.prior = {(64, ("ar", 0)): 1.17, (64, ("ddtree", 8)): 3.3}
    real = {(("ar", 0), False): 1.2, (("ar", 0), True): 1.5,       # overhead 0.03 / 0.33
            (("ddtree", 8), False): 3.4, (("ddtree", 8), True): 3.95}  # overhead 0.1 / 0.65
    tau = {("ar", 0): 1.0, ("ddtree", 8): 2.4}  # fresh: 1 / 1.5 = 0.67 beats 2.4 / 3.95 = 0.61
    for cand, fresh in [(("ar", 0), False)] * 4 + [(("ddtree", 8), True)] * 4:  # the warm-up's mix
        controller.observe(64, cand, real[(cand, fresh)], tau[cand], fresh)
    chosen = run_fresh_every_fourth(controller, 200, real, tau)
    assert all(c == ("ar", 0) for fresh, c in chosen[40:]), [x for x in chosen[40:] if x[1] != ("ar", 0)][:5]
    assert controller.step_cost(64, ("ar", 0), fresh=True) == 1.5  # its own rounds' median


def test_stale_class_overhead_does_not_lock_plain_decoding_out_of_fresh_rounds():
    """H200 trace at concurrency 64 (HumanEval, T=0, phase-4 drafter): plain decoding's fresh-round
    overhead came from a few early rounds (+0.27 ms over the start-up curve) and was never
    refreshed, because the chain then won every fresh round (2.1 tokens in 2.94 ms against an
    estimated 1.50 ms for one; plain decoding's fresh rounds really took 1.22 ms). Its own
    overlapped rounds bound the estimate, so it is tried fresh, measured, and keeps those rounds."""
    plain, chain, tree = ("ar", 0), ("dflash", 0), ("ddtree", 8)
    controller = AutoBudget([plain, chain, tree], bucket_of=lambda n: n, explore_every=10**9)
    controller.prior = {(64, plain): 1.238, (64, chain): 2.838, (64, tree): 3.29}
    real = {(plain, False): 1.19, (plain, True): 1.22, (chain, False): 2.90, (chain, True): 2.94,
            (tree, False): 3.25, (tree, True): 3.30}
    tau = {plain: 1.0, chain: 2.1, tree: 2.5}
    for _ in range(4):  # the warm-up: slow first fresh plain rounds, then every candidate's tries
        controller.observe(64, plain, 1.238 + 0.27, 1.0, fresh=True)
    for cand, fresh in [(plain, False), (chain, False), (chain, True), (tree, False), (tree, True)] * 4:
        controller.observe(64, cand, real[(cand, fresh)], tau[cand], fresh)
    controller.samples.pop((64, plain, True))  # its rounds aged out; the class overhead stayed
    chosen = run_fresh_every_fourth(controller, 400, real, tau)
    assert all(c == plain for fresh, c in chosen), [x for x in chosen if x[1] != plain][:5]
    assert abs(controller.step_cost(64, plain, fresh=True) - 1.22) < 1e-9  # its own rounds' median


def test_own_step_times_replace_a_wrong_startup_curve():
    """The start-up curve says the chain is as cheap as plain decoding; its real steps take twice
    as long. Once the chain has run a few steps, its own times decide and plain decoding wins."""
    controller = AutoBudget(pow2_candidates(8), bucket_of=lambda n: n)
    controller.prior = {(16, c): 1.0 for c in controller.candidates}
    real = {"ar": 1.0, "dflash": 2.0, "ddtree": 3.0}
    run(controller, 16, 100, tree_tau, lambda n, c: real[c[0]])
    assert controller.step_cost(16, ("dflash", 0)) == 2.0
    assert controller.best(16) == ("ar", 0)
    late = run(controller, 16, 64, tree_tau, lambda n, c: real[c[0]])
    assert late.count(("ar", 0)) >= 62


def test_exploration_reaches_trees_that_are_not_neighbours_of_the_best():
    """Plain decoding leads, the chain is clearly worse, a tree is close: the tree is retried
    (not only the chain next to plain decoding), so a stale tau estimate gets corrected."""
    controller = AutoBudget(pow2_candidates(32), bucket_of=lambda n: n)
    cost = {"ar": 1.0, "dflash": 2.0, "ddtree": 1.5}
    tau = {("ar", 0): 1.0, ("dflash", 0): 1.2}
    stale = lambda c: tau.get(c, 1.4)  # noqa: E731 - trees looked worse than plain decoding
    run(controller, 1, 40, stale, lambda n, c: cost[c[0]])
    assert controller.best(1) == ("ar", 0)
    tau.update({("ddtree", b): 1.8 for b in (8, 16, 32)})  # now a tree would win (1.8 / 1.5 > 1)
    seen = run(controller, 1, 200, stale, lambda n, c: cost[c[0]])
    assert controller.best(1)[0] == "ddtree"
    assert ("dflash", 0) not in seen[:100]  # never plausible, never retried


def test_auto_rate_close_to_the_best_in_simulation():
    """Step costs and tau of the H200 grid at c=1 (ms; tau at T=0, HumanEval), accepted lengths
    drawn from a geometric law with that mean: over 500 steps after a 100-step start, auto's
    tokens per ms must come within 5% of the best candidate's (a 32-node tree: 1.18 tokens/ms
    against plain decoding's 1.02). A short tau average got stuck on worse candidates (0.87)."""
    import random
    cost = {("ar", 0): 0.98, ("dflash", 0): 1.33, ("ddtree", 8): 1.40, ("ddtree", 16): 1.45,
            ("ddtree", 32): 1.52, ("ddtree", 64): 1.68, ("ddtree", 128): 2.0}
    tau = {("ar", 0): 1.0, ("dflash", 0): 1.48, ("ddtree", 8): 1.6, ("ddtree", 16): 1.7, ("ddtree", 32): 1.8,
           ("ddtree", 64): 1.91, ("ddtree", 128): 2.0}
    best = max(tau[c] / cost[c] for c in cost)
    rates = []
    for seed in range(10):
        rng = random.Random(seed)

        def accepted(cand):
            length, keep = 1, 1 - 1 / tau[cand]
            while length < 16 and rng.random() < keep:
                length += 1
            return length

        controller = AutoBudget(pow2_candidates(128), bucket_of=lambda n: n)
        controller.prior = {(1, c): 0.95 * v for c, v in cost.items()}  # graph time, no host work
        tokens = ms = 0.0
        for step in range(600):
            cand = controller.choose(1)
            length = accepted(cand)
            controller.observe(1, cand, cost[cand] * rng.uniform(0.97, 1.05), length)
            if step >= 100:
                tokens, ms = tokens + length, ms + cost[cand]
        rates.append(tokens / ms / best)
    assert sum(rates) / len(rates) >= 0.95, rates


def test_tau_is_monotone_in_the_budget():
    controller = AutoBudget(pow2_candidates(32), bucket_of=lambda n: n, min_tries=1)
    for cand, tau in [(("ar", 0), 1.0), (("dflash", 0), 1.5), (("ddtree", 8), 2.0), (("ddtree", 16), 1.2),
                      (("ddtree", 32), 1.1)]:
        controller.observe(1, cand, 1.0, tau)
    assert controller.tau_estimate(("ddtree", 32)) == 2.0  # a 32-node tree holds the 8-node one
    assert controller.tau_estimate(("dflash", 0)) == 1.5


def test_switching_methods_every_step_stays_lossless(smol, tokenizer, prompts, ar_reference):
    """Auto moves between plain decoding, the chain and trees step by step; the drafter's context
    must stay right across those switches (plain steps store it too)."""
    llm = make_llm(smol, tokenizer, method="ddtree", budget="auto", drafter=SHIPPED, max_budget=32)
    cycle = itertools.cycle(llm.engine.auto.candidates)
    llm.engine.auto.choose = lambda n, fresh=False: next(cycle)
    outs = llm.generate(prompts[:6], GREEDY_64)
    for p, o in zip(prompts[:6], outs):
        assert o.token_ids == ar_reference[tuple(p)]
    assert len(set(llm.engine.step_choices)) == len(llm.engine.auto.candidates)
    lens = [n for o in outs for n in o.metrics.accepted_lengths]
    assert sum(lens) / len(lens) > 1.3  # speculative steps accepted tokens (context was right)


def test_a_tree_step_gives_every_smaller_tree_its_accepted_length(smol, tokenizer, prompts):
    """Auto's tau samples for smaller trees, taken from a bigger tree's step, equal what those
    trees accept when they run the same step themselves (greedy, first step after the prompt)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = make_llm(smol, tokenizer, method="ddtree", budget="auto", drafter=SHIPPED, max_budget=32)
    llm.engine.auto.choose = lambda n, fresh=False: ("ddtree", 32)
    seen = []
    observe_tau = llm.engine.auto.observe_tau
    llm.engine.auto.observe_tau = lambda cand, tau, **kw: (seen.append((cand, tau)), observe_tau(cand, tau, **kw))
    fixed = {b: make_llm(smol, tokenizer, method="ddtree", budget=b, drafter=SHIPPED) for b in (7, 31)}
    checked = 0
    for p in prompts[:5]:
        seen.clear()
        llm.generate([p], params)
        predicted = {cand[1]: tau for cand, tau in seen[:4]}  # the first step's samples
        assert set(predicted) == {7, 15, 31, 32}
        for b, other in fixed.items():
            actual = other.generate([p], params)[0].metrics.accepted_lengths[0]
            assert predicted[b] == actual, (b, predicted, actual)
            checked += actual > 1
    assert checked > 0  # some steps accepted drafted tokens, so the cut was tested


def test_deferred_context_drafts_like_storing_it_every_round(smol, tokenizer, prompts):
    """Plain rounds under auto keep only their tapped features (the tap cache); the next
    speculative round projects them into the drafter's context first. Across scripted switches,
    with overlapped rounds (a tree launched behind a plain round and the reverse) and requests
    of different lengths, the drafts must be those of a run that stores the context every
    round: the same accepted length at every step."""
    script = [("ar", 0)] * 3 + [("ddtree", 16), ("ar", 0), ("dflash", 0)] + [("ar", 0)] * 2 + [
        ("ddtree", 8), ("ddtree", 16), ("ar", 0), ("ddtree", 16)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (48, 30, 64, 41)]
    _deferred_like_stored(smol, tokenizer, prompts[:4], params, script, min_overlapped=20)


def test_deferred_prompt_context_drafts_like_storing_it(smol, tokenizer, prompts):
    """The prefill under auto keeps the prompt's taps only: a tree right after the prefill
    projects the whole prompt first (the two-chunk prefill of a long prompt included)."""
    script = [("ddtree", 16), ("ar", 0), ("ddtree", 8), ("ar", 0), ("ar", 0)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 33)]
    long_prompt = (prompts[0] * 8)[:300]  # over max_num_batched_tokens=256: prefilled in two chunks
    _deferred_like_stored(smol, tokenizer, [prompts[1], long_prompt], params, script, min_overlapped=5,
                          max_num_batched_tokens=256)


def _deferred_like_stored(smol, tokenizer, prompts, params, script, min_overlapped, **engine):
    runs = {}
    for defer in (True, False):
        llm = make_llm(smol, tokenizer, method="ddtree", budget="auto", drafter=SHIPPED, max_budget=16,
                       overlap_steps=True, **engine)
        runner = llm.engine.runner
        assert runner.tap_cache is not None  # budget="auto" defers by default
        if not defer:
            runner.tap_cache = None  # store the drafter's K/V at the prefill and every plain round instead
        cycle = itertools.cycle(script)
        llm.engine.auto.choose = lambda n, fresh=False: next(cycle)
        outs = llm.generate(prompts, params)
        runs[defer] = [(o.token_ids, o.metrics.accepted_lengths) for o in outs]
        if defer:  # the prompts were caught up too
            assert runner.caught_up_tokens > sum(map(len, prompts)) and llm.engine.overlapped_rounds > min_overlapped
    assert runs[True] == runs[False]
    lens = [n for _, accepted in runs[True] for n in accepted]
    assert max(lens) > 3  # drafts were accepted, so they depended on the context


CLOSED_LOOP_CANDIDATES = auto_candidates(127, True)


def simulate_closed_loop(concurrency, requests, runs, seed, fixed=None):
    """``ddtree bench``'s closed loop, simulated: requests of 64-192 tokens, ``concurrency`` in
    flight, the controller kept across runs; tokens/ms of each run after a warm-up run (``fixed``:
    one candidate every round instead). Costs: the H200 start-up profile (ms, bench_h200_phase7.
    json); tau: MT-Bench T=1 with the phase-7 drafter. Acceptance differs by request (a factor
    0.4-1.6 each, the same every run) and falls along a response (x1.3 at its start, x0.34 at
    token 192), so a run ends in a drain of long requests that accept less, as on the H200 (a
    15-node tree: 1.88 tokens per sequence at full batch, 1.63 in the drain)."""
    buckets = (1, 2, 4, 8, 16)
    cands = CLOSED_LOOP_CANDIDATES
    prior_ms = {1: [0.976, 1.272, 1.266, 1.31, 1.349, 1.39, 1.547],
                2: [0.987, 1.308, 1.315, 1.366, 1.39, 1.528, 1.647],
                4: [1.007, 1.336, 1.329, 1.403, 1.516, 1.622, 1.937],
                8: [1.005, 1.438, 1.439, 1.553, 1.632, 1.861, 2.247],
                16: [1.069, 1.59, 1.562, 1.687, 1.894, 2.191, 3.357]}
    tau = dict(zip(cands, (1.0, 1.39, 1.72, 1.88, 1.98, 2.05, 2.1)))

    def bucket_of(n):
        return next(b for b in buckets if b >= n)

    rng = random.Random(seed)
    auto = AutoBudget(cands, bucket_of)
    auto.prior = {(b, c): prior_ms[b][i] * 1e-3 for b in buckets for i, c in enumerate(cands)}
    factor = [random.Random(1000 + i).uniform(0.4, 1.6) for i in range(requests)]
    rates = []
    for run_index in range(runs + 1):
        pending = [[0, random.Random(i).randint(64, 192), factor[i]] for i in range(requests)]  # position, length
        live, seconds, tokens = [], 0.0, 0
        while pending or live:
            while pending and len(live) < concurrency:
                live.append(pending.pop(0))
            cand = fixed or auto.choose(len(live))
            accepted = []
            for seq in live:
                keep = min(0.95, 1 - 1 / (1 + (tau[cand] - 1) * seq[2] * max(0.3, 1.3 - seq[0] / 200)))
                k = 1
                while k < 16 and rng.random() < keep:
                    k += 1
                k = min(k, seq[1] - seq[0])
                accepted.append(k)
                seq[0] += k
            step = prior_ms[bucket_of(len(live))][cands.index(cand)] * rng.uniform(0.98, 1.04)
            if not fixed:
                auto.observe(len(live), cand, step * 1e-3, sum(accepted) / len(live))
            seconds, tokens = seconds + step, tokens + sum(accepted)
            live = [s for s in live if s[0] < s[1]]
        if run_index:
            rates.append(tokens / seconds)
    return rates


def test_auto_keeps_trees_across_closed_loop_drains():
    """At concurrency 16 trees beat plain decoding by ~9 % here, but every run ends in a drain
    whose rounds (few sequences, late in long responses) accept less. With tau the plain mean of
    the last 128 steps, those rounds filled the window, the next run started on plain decoding
    and explorations every 32 steps did not bring the trees back: 0.94x the best candidate
    (H200, MT-Bench T=1 c=16: two of four repeats ran plain decoding at full batch, 0.99-1.02x
    AR against 1.14x in the others). A step now weighs as many sequences as it ran, and
    explorations come every 8 steps (still within their 0.5 % credit)."""
    best = max(statistics.mean(simulate_closed_loop(16, 64, 2, 0, fixed=c)) for c in CLOSED_LOOP_CANDIDATES)
    plain = statistics.mean(simulate_closed_loop(16, 64, 2, 0, fixed=("ar", 0)))
    assert best > 1.05 * plain
    rates = [r for seed in range(4) for r in simulate_closed_loop(16, 64, 6, seed)]
    assert statistics.mean(rates) / best >= 0.97, [round(r / best, 3) for r in rates]
