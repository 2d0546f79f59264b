#!/usr/bin/env bash
# Continue the shipped drafter on fresh responses (phases 3-12 of the model card): a greedy pass and
# a seeded T=1 pass over the training prompts (T1_SEED: use one the drafter has not seen;
# phase 3 used 1, phase 4 used 2, phase 5 used 3, phase 6 used 4, phase 7 5 and 6, phase 8 7, phase 9 8, phase 10 9, phase 11 10, phase 12 11; until
# 2026-12-04 the seed did not reach the engine's CUDA sampler, so phases 6 and 7 got the same T=1
# responses: use 12 or more now), --distill 0.5, a fresh AdamW from the shipped
# weights, and the cosine fitted to the device time (`--minutes`: the learning rate reaches zero
# when `finish`'s call ends). Back-to-back device calls
# while the machine stays warm (see stage_and_run.md). Phase 5 (2026-12-03) staged in three calls
# (.whl + r00 + r01, r02 + r03, r04 + r05), with bench/results moved out of the tree except
# eval_drafter.json (finish and measure read it), then ran `start` in the fourth, carrying
# r06, r07, .stage/train_prompts.jsonl (`ddtree train-drafter prompts --n-sharegpt 40000
# --n-gsm8k 7473 --n-code 6000`, 6.2 MB) and .stage/eval_prompts.json (60.6 MiB in all).
#   cp .stage/gguf.r06 .stage/train_prompts.jsonl /tmp/stage/ &&
#   T1_SEED=4 bash scripts/device/train_continue.sh start    # join, two passes, train
# With ShareGPT's later turns (`... prompts ... --n-sharegpt-later 40000`: 38,153 prompts, 40.7 MB,
# 12.8 MB gzipped) the file does not fit beside two GGUF parts: `gzip -9` it, `split -n 2 -d` the
# .gz into .stage/tp.gz.00/.01, carry one with each of the second and third staging calls, and
# `cat /tmp/stage/tp.gz.0* | gunzip > /tmp/stage/train_prompts.jsonl` in the third. Phase 6 did
# (GEN_MINUTES=3 T1_SEED=4): each pass generated for 120-140 s, but the two passes with their loads
# took 380-435 s of the call, leaving `start` 2.0-2.4 training minutes (START_SECONDS, default
# 525, is the part of the 600 s call that `start` plans for).
# Send `start`, `finish` and `measure` in one batch of calls: the machine goes back 30 s after a
# call, and phase 6's `finish`, sent a minute late, found a fresh machine without the checkpoint.
# Phase 6 then restaged, put the partial weights in place of the shipped ones and ran `start`
# with LAST_MINUTES=0 (the cosine ends in that call) and an eval-drafter call after it.
#   bash scripts/device/train_continue.sh finish   # carry .stage/eval_prompts.json: train to the
#                                                  # end, export (split for $OUT), tau old and new
#   bash scripts/device/train_continue.sh measure  # carry .stage/eval_prompts.json: the grid with
#                                                  # the better of the two drafters (METHODS=...);
#   # or alone after three staging calls, carrying r06, r07 and eval_prompts: the shipped drafter
# Phase 7 (2026-12-04) ran one cosine over three calls after the three staging calls, sent as
# one batch (the training minutes: ~2.1 + 5.5 + 3.8):
#   cp .stage/gguf.r06 /tmp/stage/ && GEN_MINUTES=3 T1_SEED=5 START_SECONDS=500 LAST_MINUTES=9.5 \
#     bash scripts/device/train_continue.sh start        # carry r06, r07, eval_prompts (516 s)
#   GEN_MINUTES=3 T1_SEED2=6 MORE_SECONDS=500 LAST_MINUTES=3.8 bash scripts/device/train_continue.sh more   # 527 s
#   LAST_MINUTES=3.8 bash scripts/device/train_continue.sh finish   # carry eval_prompts (371 s)
# That used 1,504 of the session's 1,800 device seconds, with no room left for `measure`.
# Phase 8 (2026-12-04) ran `start` and `finish` (9.2 training minutes), then `measure` and the
# CUDA tests, after the three staging calls, all sent as one batch (1,697 device seconds in all):
#   cp .stage/gguf.r06 /tmp/stage/ && GEN_MINUTES=2.5 T1_SEED=7 START_SECONDS=540 LAST_MINUTES=5.5 \
#     bash scripts/device/train_continue.sh start        # carry r06, r07, eval_prompts (556 s)
#   LAST_MINUTES=5.5 bash scripts/device/train_continue.sh finish            # carry eval_prompts (460 s)
#   METHODS=ar,dflash,ddtree:63,auto bash scripts/device/train_continue.sh measure   # (353 s)
# `measure` takes CONCURRENCY (default 1,4,16,64) and BENCH_ARGS (more `ddtree bench` flags, e.g.
# BENCH_ARGS=--stop-at-eos: requests end at EOS, see bench/README).
# Phase 9 (2026-12-04, sixth session) the same with T1_SEED=8: staging, start, finish, measure and
# the CUDA tests as one batch of seven calls, 1,713 device seconds. `finish` exports model.safetensors
# (split for $OUT) and drafter_small.tar (config.json, mask_embedding.pt, train_log.jsonl): ship BOTH
# weight files (`bash scripts/device/ship_drafter.sh <files_at of finish> <phase>` does it here); phase
# 8 shipped only model.safetensors and kept phase 7's learned mask embedding.
# Phase 10 (2026-12-04, seventh session) the same with T1_SEED=9, then `measure` twice (the grid, and
# CONCURRENCY=1 BENCH_ARGS=--stop-at-eos) instead of the CUDA tests: 1,559 device seconds. Its passes
# ran slower (49-52 k tok/s) and GEN_MINUTES=2.5 stopped both at 34,816 of the 38,153 prompts, leaving
# 8.0 training minutes; GEN_MINUTES=2.8 would cover them at that rate (and train ~0.6 minutes less).
# Phase 11 (planned, 2026-12-04, eighth session, no device lent; `bash scripts/device/stage.sh` makes
# every staged file below on a fresh checkout, 2026-12-05): a new prompts file, the 38,153
# prompts plus 5,087 code prompts from permissively licensed packages' wheels (43,240, md5
# 45c2d3a5c67b674ce7387a64cbce207a; 13.6 MB gzipped, .stage/tp.gz.00/.01 of 6.8 MB, which still fit
# beside two GGUF parts; the phase-10 files are kept in .stage/phase10/):
#   ddtree train-drafter prompts --out .stage/train_prompts.jsonl --n-sharegpt 40000 --n-gsm8k 7473 \
#     --n-code 6000 --n-sharegpt-later 40000 --n-code-packages 6000
# (38,153 of them are the phase-6..10 prompts exactly; the shuffle puts them in another order, so
# the greedy pass is made again). Every pass is now packed into $OUT (<name>.rsp, responses only,
# lzma; `ddtree train-drafter pack`); copy them into .stage/ here and carry them into /tmp/stage in
# an extra staging call of a later phase on the same prompts file: `start` unpacks them, resumes
# the greedy pass where it was cut (or skips it: ~3 minutes of device time) and trains on every
# pass it has, old and new.
# Phase 11 ran (2026-12-06, twelfth session, one H100, after six refused device starts had spent 950
# of the 1,800 s) shortened to what was left, after the three staging calls, as one batch:
#   cp .stage/gguf.r06 .stage/tp.gz.01 /tmp/stage/ && cat /tmp/stage/tp.gz.0* | gunzip > /tmp/stage/train_prompts.jsonl &&
#   GEN_MINUTES=1.3 T1_SEED=10 START_SECONDS=400 LAST_MINUTES=3.0 bash scripts/device/train_continue.sh start  # 412 s
#   LAST_MINUTES=3.0 bash scripts/device/train_continue.sh finish                                               # 270 s
# Its passes stopped at 22,528 (greedy) and 24,576 (seed 10) of the 43,240 prompts; both came back
# packed and are kept in this workspace's .stage/greedy.rsp and .stage/t1_seed10.rsp (copies in
# .stage/phase11/; stage.sh cannot remake them: they are the device's outputs). Phase 12: carry
# t1_seed10.rsp with the first staging call and greedy.rsp with the second (each still fits under
# the 64 MiB beside two GGUF parts), `cp` them into /tmp/stage there; `start` then resumes the
# greedy pass at prompt 22,529 and adds a new seed (T1_SEED=11).
# Those .rsp files live only in the workspace that received them (.stage/ is not in git); a fresh
# checkout has none, and `start` then makes the greedy pass again. PAST_EOS=F (default 0) passes
# `generate --past-eos F` to every pass of the call: a fraction F of the responses ignore EOS and
# run to 256 tokens, so the drafter also learns the made-up turn SmolLM2 writes after EOS, which the
# speed grid's fixed lengths ask it to follow (the drafter card, "Text after EOS"). A pass made with
# one share is not resumed with another. Phase 12 as planned for 2026-12-06 (not run: eleven device
# starts were refused that session), after the three staging calls (the second carrying tp.gz.00):
#   cp .stage/gguf.r06 .stage/tp.gz.01 /tmp/stage/ && cat /tmp/stage/tp.gz.0* | gunzip > /tmp/stage/train_prompts.jsonl &&
#   PAST_EOS=0.25 GEN_MINUTES=1.3 T1_SEED=11 START_SECONDS=420 LAST_MINUTES=3.0 bash scripts/device/train_continue.sh start
#   LAST_MINUTES=3.0 bash scripts/device/train_continue.sh finish
# then the grid with the export (`ddtree bench --drafter /tmp/export`, with and without --stop-at-eos):
# its tau at the grid's lengths against the shipped drafter's says whether the post-EOS text helped,
# and finish's eval (which stops at EOS) whether it cost tau before EOS.
# Phase 12 ran so (2026-12-07, nineteenth session, one H100, after three refused starts), with two
# staging calls instead of three: with the shipped model.safetensors (31.6 MB) moved out of the
# tree for them, four GGUF parts fit per call (r00-r03 + tp.gz.00 + .whl, then r04-r06 +
# tp.gz.01 and the gunzip); the drafter back in place for `start` (carry r07, eval_prompts;
# 441 s) and `finish` (311 s); bench/results/train_phase12_h100.log. Its passes (greedy 16,384 and
# seed 11 18,432 of the 43,240 prompts, both made with PAST_EOS=0.25) are in this workspace's
# .stage/greedy.rsp and .stage/t1_seed11.rsp (copies in .stage/phase12/): a phase 13 that carries
# them must pass PAST_EOS=0.25 to resume them, and a new seed (T1_SEED=12).
# The run's checkpoint lives in the machine's /tmp (its optimizer state is too big for $OUT), so
# `start` also brings its weights back (partial_model.safetensors.p*, partial_small.tar): if the
# machine goes back between calls (it did on 2026-12-03, after the first try at phase 5's first call), restage,
# rebuild the folder from those files, carry it and rerun `start` with INIT=<folder>: a fresh
# optimizer and cosine from the partial weights instead of starting the phase over.
# The cosine runs over training time (`--minutes`), not steps: until phase 5, `finish` fitted the
# run's length in steps to the first call's rate, and phase 5's second call ran ~2x faster (~2.5
# then ~5.3 steps/s), so its cosine ended 3 of the 5.5 minutes in. Not yet used for a phase; smoke
# test on the H200 (bench/results/minutes_smoke_h200.log): --minutes 0.5 split 0.26 + rest over
# a resume, done at 0.5 training minutes with the learning rate down to 2 % of its peak at the last
# logged step.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
SHIPPED=ddtree/drafters/SmolLM2-135M-Instruct-DFlash
T0=$(date +%s)
minutes_left() { python3 -c "print(max(0.5, ($1 - ($(date +%s) - $T0)) / 60))"; }  # of a budget in s
TRAIN() {  # every response pass on the machine (`more` adds a second T=1 pass to a resumed run)
  python3 -m ddtree.cli train-drafter train --data /tmp/resp_*.pt \
    --target $G --init ${INIT:-$SHIPPED} --batch-size 32 --anchors 64 \
    --lr ${LR:-3e-4} --distill 0.5 --run-dir /tmp/run4 "$@"
}
elapsed_minutes() { python3 -c "import torch; print(torch.load('/tmp/run4/checkpoint.pt', weights_only=False)['elapsed'] / 60)"; }
export_partial() {
  python3 -m ddtree.cli train-drafter export --run-dir /tmp/run4 --out /tmp/export_partial
  split -b 12000000 -d /tmp/export_partial/model.safetensors $OUT/partial_model.safetensors.p
  tar -cf $OUT/partial_small.tar -C /tmp/export_partial config.json mask_embedding.pt -C /tmp/run4 train_log.jsonl \
    -C /tmp $(cd /tmp && ls responses_*.json)
}
gen() {  # name, temperatures, seed: /tmp/resp_<name>.pt (resumed where a packed pass was carried),
         # packed into $OUT/<name>.rsp so that a later phase can train on it again without generating it
  python3 -m ddtree.cli train-drafter generate --prompts /tmp/stage/train_prompts.jsonl --out /tmp/resp_$1.pt \
    --target $G --max-new-tokens 256 --chunk 2048 --max-num-seqs 256 --kv-cache-gb 24 \
    --max-minutes ${GEN_MINUTES:-1.5} --temperatures "$2" --seed "$3" --past-eos ${PAST_EOS:-0} 2>&1 | tail -1 | tee /tmp/responses_$1.json
  python3 -m ddtree.cli train-drafter pack --data /tmp/resp_$1.pt --out $OUT/$1.rsp
}
case "$1" in
start)
  cp .stage/gguf.r07 /tmp/stage/
  cat /tmp/stage/gguf.r0* > $G
  md5sum $G
  for f in /tmp/stage/*.rsp; do  # passes of earlier phases over this prompts file, carried in
    [ -e "$f" ] && python3 -m ddtree.cli train-drafter unpack --packed $f --prompts /tmp/stage/train_prompts.jsonl \
      --target $G --out /tmp/resp_$(basename $f .rsp).pt
  done
  gen greedy 0 0   # deterministic: finishes a carried greedy.rsp, or makes it
  gen t1_seed${T1_SEED:?set T1_SEED to a seed the drafter has not seen} 1 $T1_SEED
  # Train until ~9 min into the call, on a cosine over this call's minutes and finish's LAST_MINUTES
  # (--minutes: by training time, so a faster or slower second call still ends it at zero).
  FIRST=$(minutes_left ${START_SECONDS:-525})
  TRAIN --steps 1000000 --minutes "$(python3 -c "print($FIRST + ${LAST_MINUTES:-5.8})")" \
    --max-minutes "$FIRST" 2>&1 | tail -1
  export_partial
  ;;
more)
  # A middle call (phase 7): a second T=1 pass (T1_SEED2) joins the data, then the run goes on
  # until MORE_SECONDS into the call on a cosine that still leaves finish's LAST_MINUTES.
  gen t1_seed${T1_SEED2:?set T1_SEED2 to another unseen seed} 1 $T1_SEED2
  NOW=$(minutes_left ${MORE_SECONDS:-520})
  TOTAL=$(python3 -c "print($(elapsed_minutes) + $NOW + ${LAST_MINUTES:-4.0})")
  echo "schedule: $TOTAL training minutes in all, $NOW in this call"
  TRAIN --steps 1000000 --minutes "$TOTAL" --max-minutes "$NOW" 2>&1 | tail -1
  export_partial
  ;;
finish)
  LAST=${LAST_MINUTES:-5.8}
  # The cosine ends after the training minutes done so far plus LAST (start planned the same total
  # if its call ran its full time).
  TOTAL=$(python3 -c "print($(elapsed_minutes) + $LAST)")
  echo "schedule: $TOTAL training minutes in all"
  TRAIN --steps 1000000 --minutes "$TOTAL" --max-minutes "$LAST" 2>&1 | tail -1
  python3 -m ddtree.cli train-drafter export --run-dir /tmp/run4 --out /tmp/export
  split -b 12000000 -d /tmp/export/model.safetensors $OUT/model.safetensors.p
  md5sum /tmp/export/model.safetensors
  tar -cf $OUT/drafter_small.tar -C /tmp/export config.json mask_embedding.pt -C /tmp/run4 train_log.jsonl
  python3 -m ddtree.cli eval-drafter --target $G --drafter /tmp/export --prompts-json .stage/eval_prompts.json \
    --budgets 8,16,32,64 --max-tokens 96 --out $OUT/eval_drafter.json > $OUT/eval.log 2>&1
  cp $OUT/eval_drafter.json /tmp/eval_new.json
  python3 - <<'EOF'
import json, os
new = json.load(open(os.environ["OUT"] + "/eval_drafter.json"))["results"]
old = json.load(open("bench/results/eval_drafter.json"))["results"]
key = lambda r: (r["dataset"], r["temperature"], r["method"], r["budget"])
old = {key(r): r["tau"] for r in old}
for r in new:
    print(f"{r['dataset']:9} T={r['temperature']:.0f} {r['method']:6} B={r['budget']:3}  "
          f"shipped {old.get(key(r), float('nan')):.3f}  new {r['tau']:.3f}")
EOF
  ;;
measure)
  if [ ! -f $G ]; then  # a grid alone: the staged parts and those carried with this call
    cp .stage/gguf.r0* /tmp/stage/ 2>/dev/null || true
    cat /tmp/stage/gguf.r0* > $G && md5sum $G
  fi
  # The new drafter runs the grid only if its mean tau at B=32 over the four cells is higher; on a
  # machine without this phase's eval (a grid alone, after staging) the shipped drafter runs it.
  DRAFTER=$(python3 - <<'EOF'
import json, os
if not os.path.exists("/tmp/eval_new.json"):
    raise SystemExit(0)
def mean32(path):
    rs = [r["tau"] for r in json.load(open(path))["results"] if r["budget"] == 32]
    return sum(rs) / len(rs)
print("/tmp/export" if mean32("/tmp/eval_new.json") > mean32("bench/results/eval_drafter.json") else "")
EOF
)
  echo "grid drafter: ${DRAFTER:-shipped}"
  python3 -m ddtree.cli bench --target $G ${DRAFTER:+--drafter $DRAFTER} --prompts-json .stage/eval_prompts.json \
    --methods ${METHODS:-ar,dflash,ddtree:32,auto} --concurrency ${CONCURRENCY:-1,4,16,64} --temperatures 0,1 \
    --datasets humaneval,mtbench --repeats ${REPEATS:-2} --max-tokens 128 --kv-cache-gb 8 ${BENCH_ARGS:-} \
    --out $OUT/bench_h200.json > $OUT/bench.log 2>&1
  tail -40 $OUT/bench.log
  ;;
esac
