#!/usr/bin/env bash
# What a bare, offline GPU machine lacks for bench/gpu_check.sh, gathered where the package index
# is reachable:
#   bash bench/gpu_bundle.sh [DIR]          (DIR: gpu_bundle/, ignored by git)
# Such a machine brings its own python with CUDA torch, transformers and mpi4py, but no hydra-core,
# omegaconf or MPI runtime, reaches no network, and takes at most 64 MiB beside the source. So:
#   DIR/site   hydra-core, omegaconf, antlr4-python3-runtime (pure python) and mpi4py, unpacked:
#              gpu_check.sh puts it first on PYTHONPATH (mpi4py too, so that it matches the MPI);
#   DIR/mpich  the MPICH wheel's bin/ (mpirun) and lib/ (libmpi.so.12), for that mpi4py.
# The versions are pyproject.toml's pins; the wheels are for CPython $PY_VERSION (3.12) on
# manylinux x86_64, whatever python runs this. It prints the size of DIR and of the source beside
# it and exits 1 when both together exceed 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu_bundle}
PY_VERSION=${PY_VERSION:-3.12}
PY=${PYTHON:-$(command -v python3)}
LIMIT=$((64 * 1024 * 1024))
ABI=cp${PY_VERSION/./}

pin() {  # the exact version pyproject.toml pins for package $1
  "$PY" - "$1" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]
every = deps["dependencies"] + [d for group in deps["optional-dependencies"].values() for d in group]
want = sys.argv[1].lower().replace("_", "-")
for dep in every:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", dep.split(";")[0].strip())
    if m and m.group(1).lower().replace("_", "-") == want:
        print(m.group(2))
        break
else:
    sys.exit(f"gpu_bundle.sh: pyproject.toml pins no {sys.argv[1]}")
EOF
}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PIP=("$PY" -m pip --disable-pip-version-check -q)
PLATFORM=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp --abi "$ABI" --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
HYDRA=$(pin hydra-core) OMEGACONF=$(pin omegaconf) MPI4PY=$(pin mpi4py) MPICH=$(pin mpich)
echo "[bundle] CPython $PY_VERSION manylinux x86_64: hydra-core $HYDRA, omegaconf $OMEGACONF, mpi4py $MPI4PY, mpich $MPICH"
"${PIP[@]}" download --no-deps -d "$WORK/wheels" "${PLATFORM[@]}" \
  "hydra-core==$HYDRA" "omegaconf==$OMEGACONF" "mpi4py==$MPI4PY" "mpich==$MPICH"
# hydra's parser runtime (its requirement as hydra states it) is published as a source archive
# only: built here (pure python, any platform)
ANTLR=$("$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
  m = z.read(next(n for n in z.namelist() if n.endswith('METADATA'))).decode(); \
  print(next(l.split()[-1] for l in m.splitlines() if l.startswith('Requires-Dist: antlr4-python3-runtime')))" \
  "$WORK"/wheels/hydra_core-*.whl)
"${PIP[@]}" wheel --no-deps -w "$WORK/wheels" "$ANTLR"

rm -rf "$DIR"
mkdir -p "$DIR/site" "$DIR/mpich"
for whl in "$WORK"/wheels/*.whl; do
  case "$(basename "$whl")" in
    mpich-*) "$PY" -m zipfile -e "$whl" "$WORK/mpich" ;;
    *) "$PY" -m zipfile -e "$whl" "$DIR/site" ;;
  esac
done
# the MPICH wheel keeps its programs and libraries under <name>.data/{scripts,data/...}: laid out
# as a prefix (bin/, lib/), as an install would, so that mpirun finds its helpers and libmpi
DATA=$(ls -d "$WORK"/mpich/mpich-*.data)
mkdir -p "$DIR/mpich/bin" "$DIR/mpich/lib"
[ -d "$DATA/scripts" ] && cp -a "$DATA/scripts/." "$DIR/mpich/bin/"
[ -d "$DATA/data/bin" ] && cp -a "$DATA/data/bin/." "$DIR/mpich/bin/"
cp -a "$DATA/data/lib/." "$DIR/mpich/lib/"
chmod +x "$DIR"/mpich/bin/*
# not loaded by mpi4py or mpirun: the standard-ABI library (13 MiB), archives, compiler wrappers' data
rm -rf "$DIR/mpich/lib/pkgconfig" "$DIR"/mpich/lib/*.a "$DIR"/mpich/lib/libmpi_abi.so* "$DIR"/mpich/bin/*_abi
find "$DIR" -name "__pycache__" -prune -exec rm -rf {} +
ANTLR_VERSION=$(basename "$WORK"/wheels/antlr4_python3_runtime-*.whl | cut -d- -f2)
printf '%s\n' "hydra-core==$HYDRA" "omegaconf==$OMEGACONF" "antlr4-python3-runtime==$ANTLR_VERSION" \
  "mpi4py==$MPI4PY" "mpich==$MPICH" "python=$PY_VERSION" > "$DIR/BUNDLE.txt"

BUNDLE=$(du -sb "$DIR" | cut -f1)
SOURCE=$(git ls-files -co --exclude-standard -z | "$PY" -c \
  "import os, sys; print(sum(os.path.getsize(p) for p in sys.stdin.read().split('\0') if os.path.isfile(p)))")
TOTAL=$((BUNDLE + SOURCE))
mib() { "$PY" -c "print(f'{$1 / 2**20:.1f} MiB')"; }
echo "[bundle] $DIR: $(mib "$BUNDLE"); the source beside it: $(mib "$SOURCE"); together $(mib "$TOTAL") of 64 MiB"
if [ "$TOTAL" -gt "$LIMIT" ]; then
  echo "gpu_bundle.sh: $(mib "$TOTAL") is over the 64 MiB a GPU machine takes beside the source" >&2
  exit 1
fi
if [ "$DIR" = gpu_bundle ]; then
  echo "[bundle] on the GPU machine: bash bench/gpu_check.sh OUT_DIR (it finds gpu_bundle/ itself)"
else
  echo "[bundle] on the GPU machine: GPU_BUNDLE=$DIR bash bench/gpu_check.sh OUT_DIR"
fi
