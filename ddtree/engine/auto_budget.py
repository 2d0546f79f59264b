"""``budget="auto"``: pick each step's speculation for the batch it runs.

A step over n sequences with candidate c (plain decoding, the DFlash chain, or a DDTree of
budget b) commits about n * tau(c) tokens in cost(n, c) seconds, so the controller runs the
candidate with the largest tau(c) / cost(n, c):

- cost: the median wall time of the candidate's recent steps at this batch bucket once it has
  ``min_tries`` of them (a median shrugs off a stall). Before that, on CUDA, a curve per batch
  bucket measured at start-up (replaying each captured step graph on padding rows) plus the
  bucket's host overhead (median of wall - graph time over recent real steps; plain rounds and
  speculative rounds apart: a speculative round's overhead carries the catch-up of deferred
  drafter context and the tree's inputs, and borrowed by plain decoding it priced plain fresh
  rounds at 1.8-1.9 ms against 1.5 ms measured at concurrency 64 in an H200 trace. Never tried
  fresh there, plain decoding lost every fresh round to an 8-node tree, 6 % slower per token.
  Without samples of its own class a candidate gets no overhead: an estimate too low is
  corrected by the rounds it wins, one too high never is).
  With the curve alone, auto ran 11% of its steps on the chain at c=16 in the H200 grid, where
  the chain measured 0.65x the speed of plain decoding.
  Costs are kept apart for rounds launched behind an unread one (overlapped: the host's work is
  hidden, a round costs its GPU time) and fresh rounds (after a prefill or a change of batch:
  the host's preparation adds ~0.25 ms on the H200), and a round is chosen with the costs of its
  kind. Mixed together, plain decoding's estimate swung by +-20 % at concurrency 64 with the
  last 9 rounds' mix (1.27 ms overlapped, 1.52 ms fresh in an H200 trace) and flipped close
  calls to trees; and a fixed host cost per round is worth more to a round that commits more
  tokens, so a fresh round may rightly choose a tree where an overlapped one does not. Until a
  class has rounds of its own, the candidate's median in the other class bounds its estimate
  (a stale class overhead otherwise never gets corrected; see ``step_cost``).
- tau: tokens committed per sequence per step, the mean over the candidate's last
  ``tau_window`` steps (plain decoding is exactly 1), lifted to the best smaller tree's (a
  bigger tree contains it). A tree's step also counts for every smaller tree: the first b nodes
  of a tree are the tree of budget b, so cutting the accepted path at the first node past b
  gives what that tree would have accepted. (Without this, a smaller tree's estimate rested on
  its few exploration steps: at c=1 in the H200 grid auto ran B=64 in 224 of 262 steps where
  B=32 was 1.05x faster.) One step's accepted length varies a lot (1 to 16), and a candidate's
  estimate only moves when it runs: a short average (an EMA of weight 0.2 before) dips by
  chance, the candidate stops running and the dip sticks. In a simulation of the H200's c=1
  costs and tau (``test_auto_rate_close_to_the_best_in_simulation``) that left auto at 0.87x
  the best candidate's rate; the window of 128 reaches 0.97x. The mean is per sequence: a step
  weighs as many sequences as it ran. Weighted alike, the rounds of a closed loop's drain (few
  sequences, each late in a long response, accepting less: a 15-node tree 1.63 tokens per
  sequence against 1.88 at full batch, MT-Bench T=1 c=16 on the H200) filled the window at the
  end of each run, the next run started on plain decoding, and in two of four repeats auto
  stayed there at full batch (0.99-1.02x AR against 1.14x; ``test_auto_keeps_trees_across_
  closed_loop_drains``: 0.94x the best candidate, now 0.98x, with explorations every 8 steps
  instead of 32). Every candidate is tried ``min_tries`` times before the controller exploits, and
  every ``explore_every`` steps it tries the least recently run of the candidates whose
  estimate is within ``explore_margin`` of the best, so estimates stay fresh. (Trying only the
  best's neighbours left trees unexplored behind plain decoding after a change of load: at
  c=1 auto stayed on plain decoding while a 32-node tree was 1.11x faster.) An exploration
  also needs credit: every step earns ``explore_budget`` (0.5 %) of its cost, and exploring a
  candidate spends its expected loss against the best (its cost times one minus its rate over
  the best's). Under load a tree round costs 3-8 plain rounds and every 32nd step exploring lost
  1-2 % of the time at concurrency 64 on the H200 before the credit; at concurrency 1 rounds cost
  about the same and the credit binds only for candidates far behind. With it, exploring every
  8 steps instead of 32 refreshes a close candidate 4x as often for the same bounded loss. An
  exploration that crosses between plain decoding and speculation also pays a switch: the
  speculative round launched behind a plain one first catches up the drafter's deferred
  context, and its preparation outlasts the plain round's GPU time (in an H200 trace at
  concurrency 64, T=1, the plain round before 6 of 8 speculative explorations took
  1.5-1.9 ms against 1.2), so the regret adds the median excess of such plain rounds. In the
  next trace (``bench_h200_trace_c64_switch_cost.json.gz``) only 4 of 9 showed an excess
  (0.3-0.4 ms), the median stayed ~0.01 ms and explorations were as frequent as before (9 against
  8 full-batch rounds): the charge binds only where switches are costly most of the time. As
  a plain round followed by a speculative one is a switch, a plain exploration from speculation
  runs two rounds, the first measured: with one, plain decoding was never measured while trees
  led, its estimate stuck 0.34 ms high, and auto ran 8-node trees at 0.95x plain decoding's speed
  (H200, concurrency 64, ``bench_h200_trace_c64_join_wait.json.gz``).

A rule that took the cheapest step among candidates within 5% of the best rate (meant to
leave trees and the chain when they were barely ahead of plain decoding) was measured on the H200
and removed: small trees came within 5% of the best tree and took most steps (at c=1, 8-node trees
in 319 of 330 steps at 0.89x the 32-node tree's speed; at c=16 0.76x plain decoding).

``ar_margin`` (default 0): speculation runs only when its rate beats plain decoding's by this
fraction. In an H200 trace with every request of one length (HumanEval and MT-Bench, T = 0 and
1, concurrency 16 and 64), margins 0 / 0.1 / 0.2 gave auto 0.71-0.95x / 0.78-1.03x /
0.82-1.02x the best of plain decoding and the chain, because one length puts plain decoding in
lockstep (see ``ddtree.bench.speed``), which per-step rates do not see. A margin also slows the
return to a tree after a chance dip of its tau estimate (``test_auto_rate_close_to_the_best_in_
simulation``: 0.92x instead of 0.97x the best at c=1 with 0.1), so it is not the default.

A hysteresis between plain decoding and speculation (leaving the side chosen last only for a 3 %
lead in rate; moves among trees and the chain free) was measured side by side on an H100
(``bench_h100_capture_graphs.json``, ``auto:switch=0.03``) and removed: 1.001x plain ``auto``
over 16 cells, and at MT-Bench T=1 c=64, the close call it was meant for, 0.979x: once on 7-node
trees it stayed there while plain decoding was faster.

Larger batches make verification cost grow with the tree, so the choice slides from big trees
at concurrency 1 to small trees, the chain, or plain decoding when the GPU is saturated.
"""
from __future__ import annotations

import statistics
from collections import deque

# One below powers of two: a tree of b nodes verifies b + 1 tokens (the root too), and 2^k tokens
# fill the kernels' tiles where 2^k + 1 spill into one more (the tree kernel pads a 65-column
# ancestor mask to 128; a 65-query tree takes five 64-row attention tiles at batch 1, 64 take four).
# On the H200 (bench_h200_final.json) B=63 built in 86-90 us against B=64's 104-108 but verified
# in 15 us more, rounds 0.2-0.7 % shorter; B=31 rounds were 0-3 % shorter than B=32's of an earlier
# grid at c=4-16. The node dropped is the tree's least likely (tau the same within noise).
AUTO_BUDGETS = (7, 15, 31, 63, 127)
PLAIN = ("ar", 0)


def auto_candidates(cap: int, has_drafter: bool, budgets=AUTO_BUDGETS) -> list[tuple[str, int]]:
    """Candidates in increasing cost order: plain, chain, then trees of ``budgets`` up to ``cap``
    (the cap itself unless it is one node above a candidate, e.g. 128 beside 127)."""
    if not has_drafter:
        return [("ar", 0)]
    budgets = {b for b in budgets if b <= cap}
    if cap > 0 and cap - 1 not in budgets:
        budgets.add(cap)
    budgets = sorted(budgets)
    return [("ar", 0), ("dflash", 0)] + [("ddtree", b) for b in budgets]


class Recent:
    """The last ``n`` samples and their median, kept up to date on append: ``choose`` runs before
    every round and reads a dozen medians, and re-sorting them each time cost ~45 us of host time
    per round (unhidden in fresh rounds, after every change of batch)."""

    def __init__(self, n: int):
        self.values: deque = deque(maxlen=n)
        self.median = 0.0

    def append(self, value: float) -> None:
        self.values.append(value)
        self.median = statistics.median(self.values)

    def __len__(self) -> int:
        return len(self.values)


class AutoBudget:
    def __init__(self, candidates: list[tuple[str, int]], bucket_of, tau_window: int = 128,
                 explore_every: int = 8, explore_margin: float = 0.8, min_tries: int = 4,
                 ar_margin: float = 0.0, explore_budget: float = 0.005):
        self.candidates = candidates
        self.bucket_of = bucket_of
        self.explore_every, self.explore_margin = explore_every, explore_margin
        # Explorations may lose at most this fraction of the time (expected loss against the best).
        self.explore_budget = explore_budget
        self.tau_window = tau_window
        self.min_tries = min_tries
        # Speculation must beat plain decoding's rate by this fraction to be chosen over it.
        self.ar_margin = ar_margin
        self.prior: dict[tuple[int, tuple[str, int]], float] = {}    # start-up profile
        self.tau: dict[tuple[str, int], float] = {("ar", 0): 1.0}
        # recent (sequences, tokens per sequence) per step, and their running sums (n * tau, n)
        self.tau_recent: dict[tuple[str, int], deque] = {}
        self.tau_sums: dict[tuple[str, int], list[float]] = {}
        self._taus: dict[tuple[str, int], float] | None = None  # tau_estimates(), cached
        # recent wall times per (bucket, candidate, fresh)
        self.samples: dict[tuple[int, tuple[str, int], bool], Recent] = {}
        # wall - prior, per (bucket, fresh, plain decoding or not)
        self.overhead_samples: dict[tuple[int, bool, bool], Recent] = {}
        self.tries: dict[tuple[str, int], int] = {}  # plain decoding too: its cost is measured
        self.steps = 0
        self.explore_credit = 0.0  # seconds of expected loss explorations may still spend
        self.last_run: dict[tuple[str, int], int] = {}  # observation count at its latest step
        self.observed = 0
        # excess wall time of a plain round that had a speculative one launched behind it, per bucket
        self.switch_samples: dict[int, Recent] = {}
        self.plain_again = False  # a plain exploration's second round is due

    WINDOW = 9  # recent steps whose median is a cost
    # The credit holds at most this many steps' earnings: enough for one tree round under load
    # (3-8 plain rounds at a rate gap of 10-30 %), not for a burst of them.
    CREDIT_STEPS = 256

    def step_cost(self, bucket: int, cand, fresh: bool = False) -> float | None:
        own = self.samples.get((bucket, cand, fresh))
        if own is not None and len(own) >= self.min_tries:
            return own.median
        other = self.samples.get((bucket, cand, not fresh))
        if (bucket, cand) in self.prior:
            over = self.overhead_samples.get((bucket, fresh, cand == ("ar", 0)))
            cost = self.prior[(bucket, cand)] + (over.median if over else 0.0)
            # The candidate's own rounds of the other kind bound it (fresh and overlapped rounds
            # differ by host work, 0.01-0.03 ms on the H200 now): a class's overhead comes only
            # from that class's rounds, and plain decoding's fresh rounds are rare under load, so
            # its samples went stale (1.50 ms for 1.22 ms real at c=64), the chain took 94 of 107
            # fresh full-batch rounds at 0.84x plain decoding's speed, and auto ran 0.97x AR.
            if other is not None and len(other) >= self.min_tries:
                cost = min(cost, other.median)
            # A few rounds of its own may lower the estimate, never raise it: one too low is
            # corrected by the rounds it then wins, one too high would never be.
            if own:
                cost = min(cost, own.median)
            return cost
        few = own or other
        return few.median if few else None

    def tau_estimate(self, cand) -> float:
        """A bigger tree contains every smaller one, so tau can only grow with the budget: the
        estimate is the running average, lifted to the best of the smaller trees."""
        return self.tau_estimates()[cand]

    def tau_estimates(self) -> dict[tuple[str, int], float]:
        if self._taus is not None:  # until the next observe_tau
            return self._taus
        out, lifted = {}, None
        for cand in sorted(self.candidates, key=lambda c: (c[0] == "ddtree", c[1])):
            tau = self.tau.get(cand)
            if cand[0] == "ddtree":
                known = [t for t in (tau, lifted) if t is not None]
                tau = lifted = max(known) if known else None
            if tau is not None:
                out[cand] = tau
        self._taus = out
        return out

    def costs(self, bucket: int, fresh: bool = False) -> dict[tuple[str, int], float | None]:
        return {c: self.step_cost(bucket, c, fresh) for c in self.candidates}

    def rates(self, bucket: int, fresh: bool = False, costs: dict | None = None) -> dict[tuple[str, int], float]:
        """Expected tokens per second per sequence, per candidate."""
        costs = costs or self.costs(bucket, fresh)
        taus = self.tau_estimates()
        return {c: taus[c] / costs[c] for c in self.candidates}

    def choose(self, n: int, fresh: bool = False) -> tuple[str, int]:
        """The candidate for a round over n sequences; ``fresh``: not launched behind another."""
        bucket = self.bucket_of(n)
        costs = {}
        for cand in self.candidates:  # everything is tried a few times (one step is a noisy tau)
            if self.tries.get(cand, 0) < self.min_tries:
                return cand
            costs[cand] = self.step_cost(bucket, cand, fresh)
            if costs[cand] is None:
                return cand
        rates = self.rates(bucket, fresh, costs)
        best = max(self.candidates, key=rates.get)
        if best != ("ar", 0) and rates[best] < (1 + self.ar_margin) * rates[("ar", 0)]:
            best = ("ar", 0)
        self.steps += 1
        # Every step earns explore_budget of its time as credit for exploring (capped, so a long
        # spell of steps does not buy a burst of explorations).
        step = costs[best]
        self.explore_credit = min(self.explore_credit + self.explore_budget * step,
                                  self.explore_budget * step * self.CREDIT_STEPS)
        if self.plain_again:  # the measured round of a plain exploration (see regret)
            self.plain_again = False
            return PLAIN
        if self.steps % self.explore_every == 0:
            # Only refresh candidates that could plausibly win, and only when the credit covers
            # the step's expected loss against the best (at concurrency 64 a tree round costs 3-8
            # plain rounds: exploring every 32 steps without the credit lost 1-2 % of the time in an
            # H200 trace).
            plausible = [c for c in self.candidates if c != best and rates[c] >= self.explore_margin * rates[best]
                         and self.regret(c, costs, rates, best, bucket) <= self.explore_credit]
            if plausible:
                cand = min(plausible, key=lambda c: self.last_run.get(c, -1))
                self.explore_credit -= self.regret(cand, costs, rates, best, bucket)
                self.plain_again = cand == PLAIN
                return cand
        return best

    def regret(self, cand, costs: dict, rates: dict, best, bucket: int) -> float:
        """Expected seconds an exploration of ``cand`` loses against running ``best`` for its
        tokens, plus a switch between plain decoding and speculation (there or back). Plain
        decoding explored from speculation runs two rounds: a plain round followed by a
        speculative one is a switch, whose time is not plain decoding's cost, so a single
        plain round would never be measured."""
        switch = self.switch_samples.get(bucket) if (cand == PLAIN) != (best == PLAIN) else None
        rounds = 2 if cand == PLAIN and best != PLAIN else 1
        return rounds * costs[cand] * (1 - rates[cand] / rates[best]) + (switch.median if switch else 0.0)

    def observe(self, n: int, cand, seconds: float | None, tokens_per_seq: float, fresh: bool = False,
                switch: bool = False) -> None:
        """One step's outcome; seconds=None when its wall time is not its cost (it captured a
        graph). ``fresh``: the round was not launched behind another. ``switch``: a plain round
        with a speculative one launched behind it (its excess time is the switch's)."""
        bucket = self.bucket_of(n)
        if switch and seconds is not None and cand == PLAIN:
            base = self.step_cost(bucket, cand, fresh)
            if base is not None:
                self.switch_samples.setdefault(bucket, Recent(self.WINDOW)).append(max(0.0, seconds - base))
                seconds = None  # not plain decoding's cost
        self.tries[cand] = self.tries.get(cand, 0) + 1
        self.observed += 1
        self.last_run[cand] = self.observed
        if cand != ("ar", 0):
            self.observe_tau(cand, tokens_per_seq, sequences=n)
        if seconds is None:
            return
        self.samples.setdefault((bucket, cand, fresh), Recent(self.WINDOW)).append(seconds)
        if (bucket, cand) in self.prior:
            self.overhead_samples.setdefault((bucket, fresh, cand == ("ar", 0)), Recent(self.WINDOW)).append(
                max(0.0, seconds - self.prior[(bucket, cand)]))

    def observe_tau(self, cand, tokens_per_seq: float, sequences: int = 1) -> None:
        """One step's tokens per sequence over its ``sequences`` for ``cand``: from its own step,
        or from a bigger tree's step, whose first b nodes are exactly the tree of budget b (the
        walk's result there is the accepted path cut at the first node past b). tau is the mean
        per sequence over the window's steps, so a step weighs as many sequences as it ran."""
        recent = self.tau_recent.setdefault(cand, deque(maxlen=self.tau_window))
        sums = self.tau_sums.setdefault(cand, [0.0, 0])
        if len(recent) == recent.maxlen:
            n, tau = recent[0]
            sums[0] -= n * tau
            sums[1] -= n
        recent.append((sequences, tokens_per_seq))
        sums[0] += sequences * tokens_per_seq
        sums[1] += sequences
        self.tau[cand] = sums[0] / sums[1]
        self._taus = None

    def best(self, n: int, fresh: bool = False) -> tuple[str, int] | None:
        """The current choice without exploring (None until everything was tried)."""
        bucket = self.bucket_of(n)
        if any(self.tries.get(c, 0) < self.min_tries or self.step_cost(bucket, c, fresh) is None
               for c in self.candidates):
            return None
        rates = self.rates(bucket, fresh)
        best = max(self.candidates, key=rates.get)
        return ("ar", 0) if rates[best] < (1 + self.ar_margin) * rates[("ar", 0)] else best
