#!/usr/bin/env bash
# A venv for the peer trainers that benchmarks/peer_trainers.py compares eagle3 with.
#
#   bash benchmarks/setup_peers.sh [VENV]        # default ~/venvs/peers
#
# speculators and SpecForge declare a CUDA torch and a GPU serving stack as dependencies; none of
# that runs here, so both go in with --no-deps on top of the CPU torch, plus only the small
# pure-python packages their training code imports. transformers 5.8.1 is a release that
# speculators, SpecForge and ModelOpt all accept. eagle3 itself is not installed: the benchmark
# runs the project's own `eagle3` for our training, conversion and scoring.
set -euo pipefail
VENV=${1:-$HOME/venvs/peers}
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0            # the CPU build (a plain `torch` could resolve to CUDA)
"$PIP" install -q transformers==5.8.1
"$PIP" install -q --no-deps speculators==0.9.0
"$PIP" install -q --no-deps specforge==0.2.0
# What their training modules import, found by importing them (pure python, no CUDA; openai
# and hs-connectors are imported by speculators' data module even for files on disk; datasets
# capped where speculators caps it):
"$PIP" install -q pydantic pydantic-settings pyyaml "datasets==5.1.0" safetensors accelerate tqdm psutil \
    loguru einops openai typer rich click httpx hs-connectors==0.9.0
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("speculators.train.trainer", "speculators.train.dataloader", "speculators.models.eagle3",
             "specforge.algorithms.eagle3.data", "specforge.modeling.draft.llama3_eagle", "specforge.optimizer"):
    importlib.import_module(name)
print("speculators and specforge training modules import")
PY
