#!/usr/bin/env bash
# GPU release check: device, device tests, collective bandwidth, embedding kernels.
#
#   scripts/gpu_release_check.sh [--quick] [--out DIR] [--max SIZE] [--ranks N]
#                                [--skip-tests] [--list-first]
#
# On a machine with GPUs (pip install -e '.[gpu]'):
#   1. prints the devices (nvidia-smi -L when present; CuPy's name and compute
#      capability of each device);
#   2. runs the first device checks on one rank (FIRST_TESTS below): fetch
#      buffers outliving the scatters that read them (CuPy's pool reuses
#      blocks by stream), bfloat16 refused with NumPy < 2.1.2 and working
#      otherwise, asynchronous NCCL sends and receives issued on the stream
#      they were posted on;
#   3. runs the device tests: python -m pytest -q tests/gpu;
#   4. runs `neocomm bench OP... --device -b 1K -e MAX -f 4` on NGPUS ranks, in
#      one job, for every op of `neocomm bench --list` that has a native (NCCL)
#      peer (an op that gave no result is named as a failed step);
#   5. measures the embedding kernels against a device memcpy
#      (scripts/bench_device_kernels.py);
# then prints one table and writes DIR/release_check.json (default
# ./release-check). Exits non-zero if any step failed, naming the steps.
#
# --quick: tiny sizes and few iterations (a smoke test). --max: largest
# collective size (default 256M; 16K with --quick). --ranks: ranks of the
# collective runs (default: the number of visible GPUs, at least 1).
# --skip-tests: leave out steps 2 and 3. --list-first: print the tests of
# step 2 (pytest node ids, one a line) and exit.
set -u

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PY="${PYTHON:-python}"
OUT="./release-check"
QUICK=0
MAX=""
RANKS=""
SKIP_TESTS=0
# step 2: the device checks run first (pytest node ids under the repository root)
FIRST_TESTS=(
  "tests/gpu/test_device_tiers.py::test_fetch_buffers_outlive_the_scatters_that_read_them"
  "tests/gpu/test_half_kernels.py::test_bfloat16_on_device_needs_numpy_2_1_2_with_cupy_14"
  "tests/gpu/test_backends_gpu.py::test_nccl_async_p2p_is_issued_on_the_stream_it_was_posted_on"
)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --max) MAX="$2"; shift ;;
    --ranks) RANKS="$2"; shift ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --list-first) printf '%s\n' "${FIRST_TESTS[@]}"; exit 0 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_release_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$MAX" ]; then
  if [ "$QUICK" = 1 ]; then MAX=16K; else MAX=256M; fi
fi
mkdir -p "$OUT" || { echo "gpu_release_check: cannot create $OUT" >&2; exit 2; }
rm -f "$OUT"/steps.tsv "$OUT"/bench_*.json "$OUT"/kernels.json "$OUT"/device.json \
      "$OUT"/release_check.json

step() {  # step NAME COMMAND...: run it, record its exit status
  local name="$1"; shift
  echo "== $name: $*"
  "$@"
  local rc=$?
  printf '%s\t%s\n' "$name" "$rc" >> "$OUT/steps.tsv"
  [ "$rc" = 0 ] || echo "== $name FAILED (exit $rc)" >&2
  return 0
}

# 1. the devices
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi -L
fi
step device "$PY" - "$OUT/device.json" <<'PYEOF'
import json, sys
import cupy
n = cupy.cuda.runtime.getDeviceCount()
if n < 1:
    sys.exit("no CUDA device visible to CuPy")
devices = []
for i in range(n):
    try:
        name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the device stand-in has no properties
        name = "device stand-in" if getattr(cupy, "STANDIN", False) else "unknown"
    cc = getattr(cupy.cuda.Device(i), "compute_capability", "n/a")
    devices.append({"id": i, "name": name, "compute_capability": cc})
    print(f"device {i}: {name}, compute capability {cc}")
if getattr(cupy, "STANDIN", False):
    print("NOTE: CuPy is the test stand-in (CPU): the numbers below mean nothing")
json.dump({"count": n, "standin": bool(getattr(cupy, "STANDIN", False)),
           "devices": devices}, open(sys.argv[1], "w"), indent=1)
PYEOF
if [ -z "$RANKS" ]; then
  RANKS=$("$PY" -c "import cupy; print(max(1, cupy.cuda.runtime.getDeviceCount()))" \
          2>/dev/null || echo 1)
fi

# 2. the first device checks, on one rank (the NCCL one is marked mpi: under mpirun)
if [ "$SKIP_TESTS" = 0 ]; then
  step first-checks neocomm run -n 1 -- "$PY" "$HERE/mpi_pytest.py" \
    "${FIRST_TESTS[@]/#/$ROOT/}"
fi

# 3. the device tests
if [ "$SKIP_TESTS" = 0 ]; then
  step tests "$PY" -m pytest -q "$ROOT/tests/gpu"
fi

# 4. collective bandwidth on the device, one run per op with a native peer
ITERS=()
[ "$QUICK" = 1 ] && ITERS=(-n 2 -w 1 -r 1)
OPS=$(neocomm bench --list | awk '{for (i = 2; i <= NF; i++) if ($i == "native") print $1}')
if [ -z "$OPS" ]; then
  printf 'bench-list\t1\n' >> "$OUT/steps.tsv"
  echo "== bench-list FAILED: neocomm bench --list gave no op with a native peer" >&2
fi
if [ -n "$OPS" ]; then
  # shellcheck disable=SC2086  # one word per op
  step bench neocomm run -n "$RANKS" -- neocomm bench $OPS --device -b 1K -e "$MAX" -f 4 \
    "${ITERS[@]}" --json "$OUT/bench_{op}.json"
  for op in $OPS; do
    if [ ! -s "$OUT/bench_$op.json" ]; then
      printf 'bench %s\t1\n' "$op" >> "$OUT/steps.tsv"
      echo "== bench $op FAILED: no result" >&2
    fi
  done
fi

# 5. the embedding kernels against a device memcpy
KQUICK=()
[ "$QUICK" = 1 ] && KQUICK=(--quick)
step kernels "$PY" "$HERE/bench_device_kernels.py" "${KQUICK[@]}" --json "$OUT/kernels.json"

echo "== summary"
"$PY" "$HERE/release_check_summary.py" "$OUT"
