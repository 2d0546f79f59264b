#!/usr/bin/env bash
# Put the drafter that `train_continue.sh finish` exported into the shipped folder, on this machine:
#   bash scripts/device/ship_drafter.sh <files_at of the finish call> <phase number>
# Both weight files go in (model.safetensors from its parts, and the learned mask_embedding.pt: phase
# 8 shipped only the first); the config must be unchanged, the train log is kept as train_log_phaseN.
set -euo pipefail
FROM=${1:?files_at folder of the finish call}; PHASE=${2:?phase number}
DEST=ddtree/drafters/SmolLM2-135M-Instruct-DFlash
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
tar -xf "$FROM/drafter_small.tar" -C "$TMP"
python3 -c "import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); sys.exit(a != b and 'config.json differs from the shipped one')" \
  "$TMP/config.json" "$DEST/config.json"
cat "$FROM"/model.safetensors.p0* > "$DEST/model.safetensors"
cp "$TMP/mask_embedding.pt" "$DEST/mask_embedding.pt"
cp "$TMP/train_log.jsonl" "$DEST/train_log_phase$PHASE.jsonl"
md5sum "$DEST/model.safetensors"   # compare with the md5 that `finish` printed
