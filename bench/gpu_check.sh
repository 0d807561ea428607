#!/usr/bin/env bash
# The GPU acceptance run, on a bare, offline GPU machine in about 10 minutes, compile included:
#   bash bench/gpu_check.sh OUT_DIR           (one or more CUDA GPUs)
#   bash bench/gpu_check.sh --cpu OUT_DIR     the same steps at CI's scale on a CPU (CI runs it,
#                                             tests/mpi/test_gpu_check.py, so that it cannot rot)
# Why this shape: such a machine brings a python with CUDA torch, transformers and mpi4py, but no
# hydra-core, omegaconf or MPI runtime, reaches no network and takes 64 MiB beside the source.
# So nothing is installed: the python used is $PYTHON, else python3, else .venv/bin/python (the
# first that imports torch); bench/gpu_bundle.sh's folder ($GPU_BUNDLE, default gpu_bundle/) goes
# first on PYTHONPATH (hydra, omegaconf, mpi4py) and its MPICH on PATH; every model is a
# random-weight model of a real model's shape (config/shapes.py: no weight files).
# Steps (OUT_DIR gets each one's log and files):
# 1. env: what the python brings;
# 2. the engine's forward costs (python -m pipespec_mpi.simulate.profile): GPU: SmolLM2-135M's,
#    Llama-3.2-1B's and Llama-3.1-8B's shapes in bfloat16, eager and compiled, and the compiled
#    forward checked to be what the engine says (whole graphs, at most a few, CUDA graphs captured
#    with no skip); CPU: the toy shape, eager: OUT_DIR/profile.json;
# 3. AR, SD and PipeSpec through mpirun at batch 1 and 8 (CPU: 1 and 4): GPU: random_smollm2
#    (2 ranks) and random_llama3 (3 ranks, once more with its 8B in int4, the quantized stage, and
#    on four GPUs or more once with its 8B split over two)
#    compiled, their transport NCCL where the job's ranks
#    have a GPU each (an NCCL link from 2 GPUs on), else MPI; CPU: random_toy (float64) on the
#    GPU's plug-ins (device.kernels=portable) over transport.kind=strict (gloo under NCCL's rules).
#    Outputs against AR's at batch 1 (bench/gpu_check.py job): on a GPU by the near-tie rule
#    (analysis/ties.py, epsilon $TIE_EPSILON, default 0.0625: a divergence only where the target's
#    top-2 gap is within it, each reported), on a CPU exactly;
# 4. pipespec-simulate --profile: the paper's hierarchy (1B -> 8B -> 70B, the 70B scaled from the
#    8B by weight bytes) predicted from profile.json at batch 1 and 8;
# then OUT_DIR/results.md, the table of it all. Exit 1 when any check failed, 2 when unusable.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = --cpu ]; then MODE=cpu; shift; fi
[ $# -eq 1 ] || { echo "usage: bash bench/gpu_check.sh [--cpu] OUT_DIR" >&2; exit 2; }
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$PWD

PY=""
for candidate in "${PYTHON:-}" "$(command -v python3 || true)" .venv/bin/python; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import torch" 2>/dev/null; then
    PY=$candidate
    break
  fi
done
[ -n "$PY" ] || { echo "gpu_check: no python with torch (set PYTHON=...)" >&2; exit 2; }
BUNDLE=${GPU_BUNDLE:-$ROOT/gpu_bundle}
PY_VERSION=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
if [ -f "$BUNDLE/BUNDLE.txt" ] && ! grep -qx "python=$PY_VERSION" "$BUNDLE/BUNDLE.txt"; then
  echo "gpu_check: $BUNDLE was gathered for $(grep '^python=' "$BUNDLE/BUNDLE.txt"), not this python $PY_VERSION:" \
    "left out (PY_VERSION=$PY_VERSION bash bench/gpu_bundle.sh gathers one for it)"
  BUNDLE=""
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$BUNDLE" ] && [ -d "$BUNDLE/site" ]; then export PYTHONPATH="$BUNDLE/site:$PYTHONPATH"; fi
if [ -n "$BUNDLE" ] && [ -d "$BUNDLE/mpich/bin" ]; then
  export PATH="$BUNDLE/mpich/bin:$PATH" LD_LIBRARY_PATH="$BUNDLE/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
MPIRUN=$(command -v mpirun || true)
if [ -z "$MPIRUN" ] && [ -x "$(dirname "$PY")/mpirun" ]; then MPIRUN=$(dirname "$PY")/mpirun; fi
export PIPESPEC_RUN_STAMP=${PIPESPEC_RUN_STAMP:-gpu_check}
FAIL=0
step() { echo "== $*"; }
took() { echo "   ($(($(date +%s) - $1)) s)"; }

step "1. env ($MODE mode; python $PY; bundle $([ -n "$BUNDLE" ] && [ -d "$BUNDLE/site" ] && echo "$BUNDLE" || echo none))"
"$PY" bench/gpu_check.py env $([ "$MODE" = gpu ] && echo --cuda) || exit 2
[ -n "$MPIRUN" ] || { echo "gpu_check: no mpirun (bench/gpu_bundle.sh brings MPICH's)" >&2; exit 2; }
echo "  mpirun: $MPIRUN; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

if [ "$MODE" = gpu ]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  PROFILE=(--models 135M,1B,8B --compile)
  PROFILE_TIMEOUT=240
  # the last: random_llama3 with its 8B in the engine's int4 (the paper's 70B runs so)
  JOBS=("random_smollm2 2" "random_llama3 3" "random_llama3 3 hierarchy.stages.2.quantization=int4")
  # four GPUs or more: the 8B's layers split over two of them (models/split.py), as a 70B on 40 GB GPUs
  [ "$NGPU" -ge 4 ] && JOBS+=("random_llama3 3 hierarchy.stages.2.n_gpus=2")
  JOB_ARGS=("run.batch_sizes=[1,8]" dataset.n_prompts=8 decode.max_new_tokens=48 device.compile=true)
  JOB_TIMEOUT=150
  CHECK=(--compiled --epsilon "${TIE_EPSILON:-0.0625}")
  SEEDS=3
else
  NGPU=0
  PROFILE=(--models toy --device cpu --max-batch 4 --repeats 1 --context 32)
  PROFILE_TIMEOUT=120
  JOBS=("random_toy 3")
  JOB_ARGS=("run.batch_sizes=[1,4]" dataset.n_prompts=4 decode.max_new_tokens=16 transport.kind=strict
            device.kernels=portable)
  JOB_TIMEOUT=120
  CHECK=()
  SEEDS=1
fi

step "2. the engine's forward costs: $OUT/profile.json"
t0=$(date +%s)
if timeout "$PROFILE_TIMEOUT" "$PY" -m pipespec_mpi.simulate.profile --out "$OUT/profile.json" "${PROFILE[@]}" \
  > "$OUT/profile.log" 2>&1; then
  grep -E "^[^ ]|compiled:" "$OUT/profile.log" | sed 's/^/  /' || true
  if [ "$MODE" = gpu ]; then "$PY" bench/gpu_check.py compiled "$OUT/profile.json" || FAIL=1; fi
else
  echo "  failed (rc $?): see $OUT/profile.log"; tail -20 "$OUT/profile.log"; FAIL=1
fi
took "$t0"

step "3. AR, SD and PipeSpec through mpirun"
RUNS=()
for spec in "${JOBS[@]}"; do
  read -r hier ranks extra <<< "$spec"
  case "$extra" in
    *quantization=int4*) name=$hier-int4 ;;
    *n_gpus=2*) name=$hier-split ;;
    *) name=$hier ;;
  esac
  transport=()
  if [ "$MODE" = gpu ]; then
    transport=(transport.kind=mpi)
    [ "$NGPU" -ge "$ranks" ] && transport=(transport.kind=nccl)
  fi
  echo "-- hierarchy=$hier $extra ($ranks ranks) ${transport[*]:-}"
  t0=$(date +%s)
  RUNS+=("$OUT/$name")
  # shellcheck disable=SC2086  # extra: overrides, split on spaces
  if timeout "$JOB_TIMEOUT" "$MPIRUN" -n "$ranks" "$PY" -m pipespec_mpi hierarchy="$hier" $extra run.mode=benchmark \
    "run.methods=[ar,sd,pipespec]" dataset=synthetic "${JOB_ARGS[@]}" "${transport[@]}" run.progress=false \
    hydra.run.dir="$OUT/$name" < /dev/null > "$OUT/$name.log" 2>&1; then
    grep -A8 "^method" "$OUT/$name.log" | sed 's/^/  /' || true
    "$PY" bench/gpu_check.py job "$OUT/$name" "${CHECK[@]}" || FAIL=1
  else
    echo "  failed (rc $?): see $OUT/$name.log"; tail -20 "$OUT/$name.log"; FAIL=1
  fi
  took "$t0"
done

step "4. the paper's hierarchy predicted from this profile"
if [ -f "$OUT/profile.json" ]; then
  "$PY" -m pipespec_mpi.simulate --profile "$OUT/profile.json" --batch-sizes 1,8 --seeds "$SEEDS" \
    > "$OUT/predicted.txt" 2>&1 \
    || { echo "  pipespec-simulate failed"; FAIL=1; }
  sed 's/^/  /' "$OUT/predicted.txt"
fi
"$PY" bench/gpu_check.py table "$OUT" "${RUNS[@]}" > /dev/null || FAIL=1
echo "results in $OUT (results.md); $([ "$FAIL" = 0 ] && echo 'every check passed' || echo 'SOME CHECKS FAILED')"
exit "$FAIL"
