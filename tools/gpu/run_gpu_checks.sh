#!/usr/bin/env bash
# The checks that need a GPU, run from the repository root on the GPU machine with the
# Release build from the build machine carried in build/ (bench/RESULTS.md records what each
# run measured). A run is a list of named steps, in the order given:
#
#   tools/gpu/run_gpu_checks.sh --out OUT [--base BASE] [--rounds N] STEP...
#   tools/gpu/run_gpu_checks.sh --out /tmp/gpu tests memcheck replay
#
# BASE: the `vram` binary of an earlier commit (base_batched_rounds, base_batched,
# compare_pairs_batched), or the folder of its bench/builds (builds_pairs). --rounds: how
# many rounds the alternating steps run (their default in brackets).
# Steps:
#   tests                 the whole test binary (VRAM_REQUIRE_GPU=1)
#   memcheck              compute-sanitizer memcheck over the GPU, device and stress tests
#                         (never death tests: they fork; a memcheck run with one did not finish)
#   racecheck             compute-sanitizer racecheck over the GPU tests, then the pager's five
#                         times
#   replay                the recorded traces, three runs of three passes (build/vram: the CUDA
#                         peers, no Torch peer)
#   replay_once           the recorded traces, one run of three passes
#   torch_build           builds the Torch replay peer there (Torch exists only on that machine)
#   replay_torch          torch_build, then the recorded traces with PyTorch's allocator
#   streams               the synthetic multi-stream traces (tools/traces/stream_traces.py),
#                         build/vram
#   streams_torch         the same with the Torch peer (after torch_build or replay_torch)
#   bench                 every benchmark scenario (the tables of bench/RESULTS.md)
#   pairs_batched         the pairs and batched benchmarks
#   pairs_batched_overhead  the pairs, batched and overhead benchmarks
#   batched_quick         the batched benchmark (--quick)
#   batched               the batched benchmark (full length)
#   pager                 the pager benchmark
#   base_batched          the batched benchmark (full length) of BASE
#   base_batched_rounds   the batched benchmark (--quick) of BASE and of build/vram,
#                         alternating [5 rounds]
#   compare_pairs_batched the pairs and batched benchmarks of BASE and of build/vram,
#                         alternating [2 rounds], so both builds meet the same card state
#   builds_pairs          bench/builds/batched_pairs built against an earlier commit's library
#                         (BASE/batched_pairs) and against this one (build/batched_pairs),
#                         alternating [3 rounds]
#   python                the Python checks (plug-in build, PyTorch, CuPy), no torch_compare
#   python_compare        the Python checks with torch_compare
#   offload               bench/offload_compare.py over both models with the rows of the offload
#                         goals and accelerate (after python: it uses build-torch)
#
# The runs recorded in bench/RESULTS.md name a mode: `run_gpu_checks.sh MODE OUT [BASE]
# [ROUNDS]` still runs it, as the list of steps below (with the limits it always had).
# Every log lands in OUT; OUT/results.tar.gz holds them all.
set -uo pipefail

# The modes of earlier runs, as lists of steps. NAME=STEPS; a step may carry its limit in
# seconds after a colon, and the alternating steps their rounds after a second colon.
modes=(
  "tests-sanitizers-bench=tests memcheck racecheck replay bench:400"
  "tests-replay-streams-pairs=tests memcheck replay_torch streams_torch pairs_batched"
  "tests-replay-bench=tests memcheck replay_torch bench:400"
  "tests-streams=tests memcheck torch_build streams_torch"
  "tests-replay-pairs-overhead=tests memcheck replay_torch pairs_batched_overhead"
  "tests-replay-python=tests memcheck replay_torch python:420"
  "tests-batched-pager=tests memcheck batched_quick:200 pager"
  "tests-replay-batched-builds-pager=tests memcheck replay base_batched_rounds:100:2 pager"
  "tests-replay-streams=tests memcheck replay streams"
  "python-batched-builds=python batched base_batched"
  "streams-torch=torch_build streams_torch"
  "batched-rounds=base_batched_rounds"
  "python-offload=python_offload offload"
  "bench=bench"
  "tests-builds-pairs=tests memcheck builds_pairs batched_quick:100 replay_once"
  "python=python:420"
  "replay-torch-python=replay_torch python_compare"
  "tests-python=tests memcheck python"
  "compare-pairs-batched=compare_pairs_batched"
)
mode_steps() {  # mode_steps NAME: its steps, or nothing for an unknown mode
  local entry
  for entry in "${modes[@]}"; do
    if [ "${entry%%=*}" = "$1" ]; then
      echo "${entry#*=}"
      return
    fi
  done
}

out=""
base=""
rounds=""
steps=()
run_name=""
if [ $# -ge 2 ] && [ -n "$(mode_steps "$1")" ]; then
  run_name=$1
  read -r -a steps <<<"$(mode_steps "$1")"
  out=$2
  base=${3:-}
  rounds=${4:-}
else
  while [ $# -gt 0 ]; do
    case $1 in
      --out) out=$2; shift 2 ;;
      --base) base=$2; shift 2 ;;
      --rounds) rounds=$2; shift 2 ;;
      -*) echo "unknown option '$1' (see the comment at the top of $0)" >&2; exit 2 ;;
      *) steps+=("$1"); shift ;;
    esac
  done
  run_name="${steps[*]:-}"
fi
if [ -z "$out" ] || [ ${#steps[@]} -eq 0 ]; then
  echo "usage: $0 --out OUT [--base BASE] [--rounds N] STEP... | $0 MODE OUT [BASE] [ROUNDS]" \
    "(see the comment at the top of $0)" >&2
  exit 2
fi
mkdir -p "$out/logs"
log=$out/logs
status=0
step() {  # step NAME TIMEOUT_S CMD...: runs CMD, logs it, records its exit code
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$log/steps.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >"$log/$name.txt" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start)) s" | tee -a "$log/steps.txt"
  tail -n 4 "$log/$name.txt"
  [ $rc -eq 0 ] || status=1
}
need_base() {
  if [ -z "$base" ]; then
    echo "step $1 needs BASE (--base, or the mode's third argument)" >&2
    exit 2
  fi
}
py=${PYTHON:-/opt/torch/.venv/bin/python3}

# run_step NAME [LIMIT] [ROUNDS]: one step of the list.
run_step() {
  local name=$1 limit=${2:-} count=${3:-}
  case $name in
    tests)
      export VRAM_REQUIRE_GPU=1
      step tests "${limit:-240}" ./build/tests/vram_tests
      ;;
    memcheck)
      export VRAM_REQUIRE_GPU=1
      step memcheck "${limit:-240}" compute-sanitizer --tool memcheck --leak-check full \
        --report-api-errors no ./build/tests/vram_tests \
        --gtest_filter='*Gpu*:*/device.*:*Stress*:-*DeathTest*' --gtest_brief=1
      ;;
    racecheck)
      step racecheck "${limit:-120}" compute-sanitizer --tool racecheck ./build/tests/vram_tests \
        --gtest_filter='*Gpu*' --gtest_brief=1
      step racecheck_pager 150 compute-sanitizer --tool racecheck ./build/tests/vram_tests \
        --gtest_filter='WeightPagerGpu.*' --gtest_repeat=5 --gtest_brief=1
      ;;
    replay)
      step replay "${limit:-240}" ./build/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz \
        --json "$log/replay.json"
      ;;
    replay_once)
      step replay "${limit:-240}" ./build/vram replay --runs 1 --passes 3 bench/traces/*.csv.gz \
        --json "$log/replay.json"
      ;;
    torch_build)
      local prefix
      prefix=$($py -c 'import torch;print(torch.utils.cmake_prefix_path)')
      step torch_build "${limit:-300}" bash -c "cmake -S . -B build-torch-replay -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DVRAM_BUILD_TESTS=OFF -DVRAM_BUILD_BENCH=OFF \
        -DVRAM_TEST_KERNELS=OFF -DVRAM_WITH_TORCH=ON -DCMAKE_PREFIX_PATH=$prefix && \
        cmake --build build-torch-replay -j16 --target vram_cli"
      ;;
    replay_torch)
      run_step torch_build
      step replay_torch "${limit:-300}" ./build-torch-replay/vram replay --runs 3 --passes 3 \
        bench/traces/*.csv.gz --json "$log/replay_torch.json"
      ;;
    streams | streams_torch)
      local vram=./build/vram
      [ "$name" = streams_torch ] && vram=./build-torch-replay/vram
      step replay_streams "${limit:-300}" bash -c "python3 tools/traces/stream_traces.py \
        $log/stream_traces && $vram replay --runs 3 --passes 3 $log/stream_traces/streams1.csv \
        $log/stream_traces/streams4.csv $log/stream_traces/streams8.csv \
        $log/stream_traces/streams16.csv --json $log/replay_streams.json && \
        rm -r $log/stream_traces"
      ;;
    bench)
      step bench "${limit:-560}" ./build/vram bench \
        --scenario pairs,threads,batched,mixed,replay,overhead,pagein,pinning,driver,pager \
        --json "$log/bench.json" --markdown "$log/bench.md" --svg "$log/bench.svg"
      ;;
    pairs_batched)
      step bench "${limit:-300}" ./build/vram bench --scenario pairs,batched \
        --json "$log/bench.json" --markdown "$log/bench.md"
      ;;
    pairs_batched_overhead)
      step bench "${limit:-300}" ./build/vram bench --scenario pairs,batched,overhead \
        --json "$log/bench.json" --markdown "$log/bench.md"
      ;;
    batched_quick)
      step batched "${limit:-100}" ./build/vram bench --quick --scenario batched \
        --json "$log/batched.json" --markdown "$log/batched.md"
      ;;
    batched)
      step new_batched "${limit:-150}" ./build/vram bench --scenario batched \
        --json "$log/new_batched.json" --markdown "$log/new_batched.md"
      ;;
    pager)
      step pager "${limit:-200}" ./build/vram bench --scenario pager --json "$log/pager.json" \
        --markdown "$log/pager.md"
      ;;
    base_batched)
      need_base "$name"
      step base_batched "${limit:-150}" "$base" bench --scenario batched \
        --json "$log/base_batched.json"
      ;;
    base_batched_rounds)
      need_base "$name"
      local round
      for round in $(seq 1 "${count:-${rounds:-5}}"); do
        step "base_batched_$round" "${limit:-60}" "$base" bench --quick --scenario batched \
          --json "$log/base_batched_$round.json"
        if [ -n "$limit" ]; then  # with a markdown table, as the builds-pager mode had it
          step "new_batched_$round" "$limit" ./build/vram bench --quick --scenario batched \
            --json "$log/new_batched_$round.json" --markdown "$log/new_batched_$round.md"
        else
          step "new_batched_$round" 60 ./build/vram bench --quick --scenario batched \
            --json "$log/new_batched_$round.json"
        fi
      done
      ;;
    compare_pairs_batched)
      need_base "$name"
      local round
      for round in $(seq 1 "${count:-${rounds:-2}}"); do
        step "base_pairs_batched_$round" "${limit:-150}" "$base" bench --scenario pairs,batched \
          --json "$log/base_pairs_batched_$round.json"
        step "new_pairs_batched_$round" "${limit:-150}" ./build/vram bench \
          --scenario pairs,batched --json "$log/new_pairs_batched_$round.json"
      done
      ;;
    builds_pairs)
      need_base "$name"
      local round
      for round in $(seq 1 "${count:-${rounds:-3}}"); do
        step "base_pairs_$round" "${limit:-60}" "$base/batched_pairs" base
        step "new_pairs_$round" "${limit:-60}" ./build/batched_pairs new
      done
      ;;
    python)
      step torch_checks "${limit:-300}" env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh \
        "$log/torch"
      ;;
    python_compare)
      step torch_checks "${limit:-420}" tests/python/run_all_on_gpu.sh "$log/torch"
      ;;
    python_offload)  # the Python checks, keeping their plug-in build for `offload`
      step torch_checks "${limit:-300}" env VRAM_TORCH_COMPARE=0 \
        VRAM_TORCH_BUILD_DIR="$PWD/build-torch" tests/python/run_all_on_gpu.sh "$log/torch"
      ;;
    offload)
      step offload_compare "${limit:-330}" env PYTHONPATH="$PWD/python:$PWD/tests/python" \
        VRAM_TORCH_LIB="$PWD/build-torch/plugins/torch/libvram_torch.so" \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 "$py" bench/offload_compare.py "$log/offload" \
        --rows all_resident,vram_leaf,vram_leaf_depth1_third,vram_unit,vram_pageable,vram_everything_resident,accelerate
      ;;
    *)
      echo "unknown step '$name' (see the comment at the top of $0)" >&2
      exit 2
      ;;
  esac
}

known="tests memcheck racecheck replay replay_once torch_build replay_torch streams streams_torch
  bench pairs_batched pairs_batched_overhead batched_quick batched pager base_batched
  base_batched_rounds compare_pairs_batched builds_pairs python python_compare python_offload
  offload"
for entry in "${steps[@]}"; do  # every step checked before anything runs
  name=${entry%%:*}
  if ! [[ " $(echo $known) " == *" $name "* ]]; then
    echo "unknown step '$name' (see the comment at the top of $0)" >&2
    exit 2
  fi
  case $name in
    base_batched | base_batched_rounds | compare_pairs_batched | builds_pairs) need_base "$name" ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$log/gpu.txt" 2>&1
git log -1 --format='%H %cI' >"$log/commit.txt" 2>/dev/null || true
for entry in "${steps[@]}"; do
  IFS=: read -r name limit count <<<"$entry"
  run_step "$name" "$limit" "$count"
done
tar czf "$out/results.tar.gz" -C "$out" logs
echo "== $run_name done, status $status"
exit $status
