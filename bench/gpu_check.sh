#!/usr/bin/env bash
# GPU check, for a machine with one or more NVIDIA GPUs (under 10 minutes on one GPU):
#   bash bench/gpu_check.sh
# Runs the tiny and SmolLM2 hierarchies with 3 ranks (sharing the GPU when there is one) in
# run.mode=benchmark and prints AR/SD/PipeSpec ms/token and busy fractions per stage, the batch
# sweep (tokens/s at batch 1, 2, 4, 8), then the proposal round trip per transport. NCCL cannot put two ranks on one GPU ("duplicate GPU"), so
# with a single GPU the pipelines use transport.kind=mpi and the NCCL round trip is skipped; with two
# or more GPUs it runs with transport.kind=nccl and measures NCCL too.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
MPIRUN=.venv/bin/mpirun
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU ($($PY -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"))"
TRANSPORT=mpi
[ "$NGPU" -ge 2 ] && TRANSPORT=nccl
OUT=outputs/gpu_check/$(date +%Y%m%d-%H%M%S)
mkdir -p outputs/gpu_check
summary() {
  $PY - "$1" <<'PYEOF'
import json, sys
b = json.load(open(sys.argv[1] + "/benchmark.json"))
for m, r in b.items():
    busy = ", ".join(f"{x:.2f}" for x in r["busy_fraction"])
    print(f"  {m:<9} {r['ms_per_token']:8.2f} ms/token  speedup {r.get('speedup', float('nan')):.2f}  busy [{busy}]")
PYEOF
}
for H in tiny smollm2; do
  echo "== hierarchy=$H transport.kind=$TRANSPORT"
  timeout 200 $MPIRUN -n 3 $PY -m pipespec_mpi hierarchy=$H run.mode=benchmark decode.lookahead=2 dataset.n_prompts=3 \
    decode.max_new_tokens=64 transport.kind=$TRANSPORT run.progress=false hydra.run.dir=$OUT/$H > $OUT.$H.log 2>&1 \
    || { echo "  failed: see $OUT.$H.log"; tail -20 $OUT.$H.log; continue; }
  summary $OUT/$H
done
echo "== batch sweep: hierarchy=smollm2, run.batch_sizes=[1,2,4,8] (tokens/s per method and batch size)"
# batched slots tell their links apart by tags, which NCCL ignores: the sweep runs over MPI
timeout 400 $MPIRUN -n 3 $PY -m pipespec_mpi hierarchy=smollm2 run.mode=benchmark "run.batch_sizes=[1,2,4,8]" \
  dataset.n_prompts=8 decode.max_new_tokens=64 transport.kind=mpi run.progress=false hydra.run.dir=$OUT/batch \
  > $OUT.batch.log 2>&1 && grep -A13 "^method" $OUT.batch.log || { echo "  failed: see $OUT.batch.log"; tail -20 $OUT.batch.log; }
echo "== proposal round trip and window reads (2 ranks)"
timeout 120 $MPIRUN -n 2 $PY bench/comm_latency.py --iters 1000
