#!/usr/bin/env bash
# The GPU acceptance run (under 10 minutes on one H100 or H200; offline: only what PyPI ships):
#   bash bench/gpu_check.sh [OUT_DIR]
# 1. the portable engine's forward costs on the GPU (python -m pipespec_mpi.simulate.profile):
#    SmolLM2-135M's shapes and random-weight Llama-3.2-1B and Llama-3.1-8B in bfloat16 (a forward's
#    cost does not depend on the weights' values), verification of k = 1..16 rows and batches of
#    B = 1..64 sequences, eager and compiled: OUT_DIR/profile.json;
# 2. AR, SD and PipeSpec on the GPU, greedy, at batch 1 and 8: SmolLM2 behind the suffix drafter
#    (2 ranks) and the tiny three-stage hierarchy (3 ranks); one GPU: the ranks share it over
#    transport.kind=mpi (NCCL refuses two ranks on one GPU), 2+ GPUs: transport.kind=nccl;
#    every method's outputs must equal AR's;
# 3. pipespec-simulate --profile: the paper's hierarchy (1B -> 8B -> 70B, the 70B scaled from the
#    8B by weight bytes) predicted on this GPU with the paper's acceptance, at batch 1 and 8.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh --cuda
PY=.venv/bin/python
MPIRUN=$(command -v mpirun || echo .venv/bin/mpirun)
[ -x .venv/bin/mpirun ] && MPIRUN=.venv/bin/mpirun
OUT=${1:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU ($($PY -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')")), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
[ "$NGPU" -ge 1 ] || { echo "no CUDA device: nothing to check"; exit 1; }
TRANSPORT=mpi
[ "$NGPU" -ge 3 ] && TRANSPORT=nccl
FAIL=0

echo "== 1. forward costs (portable engine, bfloat16)"
timeout 300 $PY -m pipespec_mpi.simulate.profile --out "$OUT/profile.json" --models 135M,1B,8B --compile \
  > "$OUT/profile.log" 2>&1 || { echo "  failed: see $OUT/profile.log"; tail -20 "$OUT/profile.log"; FAIL=1; }
[ -f "$OUT/profile.json" ] && $PY - "$OUT/profile.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
print(f"  {doc['device']} ({doc['dtype']}), torch {doc['torch']}")
for name, m in doc["models"].items():
    v, b = m["verify_s"], m["batch_s"]
    cv = m.get("compiled_verify_s", {})
    print(f"  {name:>5}: AR step {1e3 * v['1']:.2f} ms eager, {1e3 * cv.get('1', float('nan')):.2f} compiled"
          f" (CUDA graphs: {m.get('compiled_graphs')} graphs, {m.get('graph_breaks')} breaks, first calls"
          f" {m.get('compile_s', float('nan')):.0f} s); verify 16 rows {1e3 * v['16']:.2f} ms; batch "
          + ", ".join(f"{k}: {1e3 * s:.1f}" for k, s in b.items()) + " ms")
EOF

check_equal() {  # every method's outputs equal AR's, per batch size
  $PY - "$1" <<'EOF'
import sys
from pipespec_mpi.records import read_records
recs = [r for r in read_records(sys.argv[1] + "/results.jsonl") if not r.warmup]
by = {}
for r in recs:
    by.setdefault((r.batch_size, r.prompt_id, r.sample_idx), {})[r.method] = r.output_ids
bad = [k for k, m in by.items() if any(v != m["ar"] for v in m.values())]
print(f"  {len(by)} prompt x batch groups, {'all methods equal AR' if not bad else f'{len(bad)} DIFFER: {bad[:4]}'}")
sys.exit(1 if bad else 0)
EOF
}
echo "== 2. AR, SD, PipeSpec on the GPU, greedy, batch 1 and 8 (transport.kind=$TRANSPORT)"
for spec in "smollm2_suffix 2" "tiny 3"; do
  set -- $spec
  echo "-- hierarchy=$1 ($2 ranks)"
  timeout 200 $MPIRUN -n "$2" $PY -m pipespec_mpi hierarchy="$1" run.mode=benchmark "run.methods=[ar,sd,pipespec]" \
    "run.batch_sizes=[1,8]" dataset.n_prompts=8 decode.max_new_tokens=64 transport.kind=$TRANSPORT \
    run.progress=false hydra.run.dir="$OUT/$1" > "$OUT/$1.log" 2>&1 \
    || { echo "  failed: see $OUT/$1.log"; tail -20 "$OUT/$1.log"; FAIL=1; continue; }
  grep -A8 "^method" "$OUT/$1.log" | sed 's/^/  /'
  check_equal "$OUT/$1" || FAIL=1
done

echo "== 3. the paper's hierarchy predicted on this GPU"
[ -f "$OUT/profile.json" ] && $PY -m pipespec_mpi.simulate --profile "$OUT/profile.json" --batch-sizes 1,8 \
  | tee "$OUT/predicted.txt" | sed 's/^/  /'
echo "results in $OUT"
exit $FAIL
