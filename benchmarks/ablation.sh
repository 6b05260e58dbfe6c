#!/usr/bin/env bash
# One row of the training ablation (docs/benchmarks.md, "Which data and settings pay"), on one
# thread so that two rows can run side by side on two cores: train a draft on a fixed store with the
# shared settings plus FLAGS, then measure its chain-3 tau with our generator on mt_bench turns.
#
#   MODEL=~/.cache/eagle3/models/SmolLM2-135M-Instruct DATA=runs/regen400 PROMPTS=mt40.jsonl OUT=runs/abl \
#       benchmarks/ablation.sh NAME [train flags...]
#   python benchmarks/ablation_table.py runs/abl          # the table
#
# STEPS (default 120) optimizer steps of 1,024 tokens; later flags override the shared ones
# (e.g. --max-tokens 2048 with STEPS=60). CPU time is written to OUT/NAME.time by /usr/bin/time.
set -euo pipefail
NAME=$1; shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
: "${MODEL:?set MODEL}" "${DATA:?set DATA}" "${PROMPTS:?set PROMPTS}" "${OUT:?set OUT}"
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
D=$OUT/$NAME
/usr/bin/time -f "%U %S %e %M" -o "$D.time" eagle3 train --store "$DATA" --model "$MODEL" --out "$D" \
  --max-steps "${STEPS:-120}" --epochs 1000 --max-tokens 1024 --lr 3e-3 --ttt-steps 3 --eval-ttt-steps 7 \
  --draft-vocab-size 8192 --val-fraction 0.1 --loss-on all --seed 0 --save-every 100000 --warmup-ratio 0.02 \
  "$@" > "$D.train.log" 2>&1
PYTHONPATH=$HERE python "$HERE/benchmarks/chain_tau.py" --model "$MODEL" --draft "$D" --prompts "$PROMPTS" \
  --max-turns 2 --steps 3 --mode chain --max-new-tokens 64 --json-out "$D.chain.json" > "$D.chain.log" 2>&1
echo "done $NAME"
