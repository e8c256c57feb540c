#!/usr/bin/env bash
# Builds libvram_torch.so and runs every PyTorch/CuPy check of vram on a GPU machine:
#   tests/python/run_all_on_gpu.sh OUT_DIR
# OUT_DIR gets build.log, one log per test file (+ junit XML with pytest), the allocator
# comparison (torch_compare.json/.md and per-run logs), summary.json and summary.md.
# Python: $PYTHON, else /opt/torch/.venv/bin/python3, else python3. Exit status: non-zero
# when the build, any test, or the comparison (a run failed or results differ) failed.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
BUILD=${VRAM_TORCH_BUILD_DIR:-$ROOT/build-torch}
JOBS=$(nproc 2>/dev/null || echo 4)
START=$(date +%s)
declare -A RESULT
FAILED=0

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }

log "vram torch/cupy checks: root $ROOT, python $PY, build $BUILD"
{ "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
  "$PY" -c 'import cupy; print("cupy", cupy.__version__)' || true
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt" | tee -a "$OUT/run.log"

log "configure + build (Release) -> $OUT/build.log"
# Torch's CMake package: with it the plug-in raises torch.OutOfMemoryError in allocator mode.
TORCH_PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
if cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DVRAM_BUILD_TESTS=OFF \
     -DVRAM_BUILD_TORCH_PLUGIN=ON -DVRAM_BUILD_TOOLS=OFF -DVRAM_BUILD_BENCH=OFF \
     ${TORCH_PREFIX:+-DCMAKE_PREFIX_PATH=$TORCH_PREFIX} \
     > "$OUT/build.log" 2>&1 &&
   cmake --build "$BUILD" -j"$JOBS" --target vram_torch >> "$OUT/build.log" 2>&1; then
  RESULT[build]=pass
else
  RESULT[build]=fail
  log "BUILD FAILED (tail of build.log):"
  tail -n 30 "$OUT/build.log" | tee -a "$OUT/run.log"
fi

export VRAM_TORCH_LIB="$BUILD/plugins/torch/libvram_torch.so"
export PYTHONPATH="$ROOT/python:$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}"
export VRAM_REQUIRE_GPU=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}

if [ "${RESULT[build]}" = pass ]; then
  if "$PY" -c 'import pytest' > /dev/null 2>&1; then RUNNER=pytest; else RUNNER=plain; fi
  log "tests (runner: $RUNNER), each file in its own process"
  for test in "$ROOT"/tests/python/test_*.py; do
    name=$(basename "$test" .py)
    if [ "$RUNNER" = pytest ]; then
      timeout 300 "$PY" -m pytest -v -s -p no:cacheprovider --junitxml="$OUT/$name.junit.xml" \
        "$test" > "$OUT/$name.log" 2>&1
    else
      timeout 300 "$PY" "$test" > "$OUT/$name.log" 2>&1
    fi
    rc=$?
    if [ $rc -eq 0 ]; then RESULT[$name]=pass; else RESULT[$name]="fail (rc $rc)"; FAILED=1; fi
    log "$name: ${RESULT[$name]}  ($(grep -cE '^(PASS|FAIL) |PASSED|FAILED' "$OUT/$name.log") result lines, log $name.log)"
  done

  # 4 rounds x 3 workloads x 2 allocators = 24 fresh processes, each paying about 5 s of
  # CUDA start and model build plus import torch besides its steps: 385 s on the H200
  # (170697d). $VRAM_TORCH_COMPARE_ARGS adds options, e.g. "--rounds 6";
  # VRAM_TORCH_COMPARE=0 skips the comparison (the checks above still run).
  if [ "${VRAM_TORCH_COMPARE:-1}" = 0 ]; then
    log "allocator comparison skipped (VRAM_TORCH_COMPARE=0)"
    RESULT[torch_compare]="skipped (VRAM_TORCH_COMPARE=0)"
  else
  log "allocator comparison: bench/torch_compare.py ${VRAM_TORCH_COMPARE_ARGS:-}"
  # shellcheck disable=SC2086  # word splitting of the extra options is intended
  timeout 900 "$PY" "$ROOT/bench/torch_compare.py" "$OUT" --lib "$VRAM_TORCH_LIB" \
    ${VRAM_TORCH_COMPARE_ARGS:-} > "$OUT/torch_compare.log" 2>&1
  rc=$?
  case $rc in
    0) RESULT[torch_compare]=pass ;;
    1) RESULT[torch_compare]="fail (results differ)"; FAILED=1 ;;
    *) RESULT[torch_compare]="fail (rc $rc)"; FAILED=1 ;;
  esac
  log "torch_compare: ${RESULT[torch_compare]}"
  [ -f "$OUT/torch_compare.md" ] && tee -a "$OUT/run.log" < "$OUT/torch_compare.md"
  fi
else
  FAILED=1
fi

ELAPSED=$(( $(date +%s) - START ))
{
  echo "# vram PyTorch/CuPy checks"
  echo
  echo "commit $(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown), ${ELAPSED} s"
  echo
  echo "| check | result |"
  echo "|---|---|"
  for key in $(printf '%s\n' "${!RESULT[@]}" | sort); do echo "| $key | ${RESULT[$key]} |"; done
  if [ -f "$OUT/torch_compare.md" ]; then echo; cat "$OUT/torch_compare.md"; fi
} > "$OUT/summary.md"
"$PY" - "$OUT/summary.json" "$ELAPSED" "$FAILED" "${!RESULT[@]}" <<PYEOF
import json, sys
path, elapsed, failed, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
results = {$(for key in "${!RESULT[@]}"; do printf '"%s": "%s", ' "$key" "${RESULT[$key]}"; done)}
json.dump({"elapsed_s": elapsed, "failed": bool(failed), "results": results}, open(path, "w"),
          indent=1)
PYEOF
cat "$OUT/summary.md"
log "done in ${ELAPSED} s; $([ $FAILED -eq 0 ] && echo ALL PASSED || echo SOME FAILED)"
exit $FAILED
