#!/usr/bin/env bash
# Sets up the environment and runs the test suite (what CI runs: .ci/run); --long adds the long
# tier (tests marked long: tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f slurm/local/setup.sh ]; then
  # A real single-node Slurm for tests/slurm (skipped with a reason where it cannot start).
  bash slurm/local/setup.sh || echo "[test.sh] local Slurm could not start; Slurm tests will skip"
fi
.venv/bin/ruff check pipespec_mpi tests
exec .venv/bin/python -m pytest -q --durations=30 "$@"
