#!/usr/bin/env bash
# The checks that need a GPU, run from the repository root on the GPU machine with the
# Release build from the build machine carried in build/ (bench/RESULTS.md records what each
# mode measured). MODE names what runs:
#   tools/gpu/run_gpu_checks.sh tests-sanitizers-bench OUT
#       tests, memcheck, racecheck, replay, every benchmark scenario
#   tools/gpu/run_gpu_checks.sh tests-replay-streams-pairs OUT
#       tests, memcheck (never death tests: they fork; a memcheck run with one did not
#       finish), replay of the recorded and of the synthetic multi-stream traces with the
#       Torch peer (built there), the pairs and batched benchmarks
#   tools/gpu/run_gpu_checks.sh tests-replay-bench OUT
#       tests, memcheck, replay with the Torch peer, every benchmark scenario
#   tools/gpu/run_gpu_checks.sh tests-streams OUT
#       tests, memcheck, the synthetic multi-stream traces with the Torch peer
#   tools/gpu/run_gpu_checks.sh tests-replay-pairs-overhead OUT
#       tests, memcheck, replay with the Torch peer, the pairs, batched and overhead benchmarks
#   tools/gpu/run_gpu_checks.sh tests-replay-python OUT
#       tests, memcheck, replay with the Torch peer, the Python checks
#   tools/gpu/run_gpu_checks.sh tests-batched-pager OUT
#       tests, memcheck, the batched benchmark (--quick) and the pager benchmark
#   tools/gpu/run_gpu_checks.sh tests-replay-batched-builds-pager OUT BASE_VRAM
#       tests, memcheck, replay of the recorded traces (no Torch peer), the batched
#       benchmark (--quick) of BASE_VRAM (a build of an earlier commit) and of build/vram
#       alternating, two rounds each, and the pager benchmark
#   tools/gpu/run_gpu_checks.sh tests-replay-streams OUT
#       tests, memcheck, replay of the recorded and of the synthetic multi-stream traces
#       (build/vram: the CUDA peers, no Torch peer)
#   tools/gpu/run_gpu_checks.sh python-batched-builds OUT BASE_VRAM
#       the Python checks (no torch_compare rounds), then the batched benchmark (full
#       length) of build/vram and of BASE_VRAM (a build of an earlier commit), alternating
#   tools/gpu/run_gpu_checks.sh streams-torch OUT
#       builds the Torch replay peer there, then the synthetic multi-stream traces with it
#   tools/gpu/run_gpu_checks.sh batched-rounds OUT BASE_VRAM [ROUNDS]
#       the batched benchmark (--quick) of BASE_VRAM and of build/vram, alternating, ROUNDS
#       (default 5) rounds each: the spread of the one-thread rows over runs
#   tools/gpu/run_gpu_checks.sh python-offload OUT
#       the Python checks (no torch_compare rounds), then bench/offload_compare.py over both
#       models with the rows of the offload goals and accelerate
#   tools/gpu/run_gpu_checks.sh bench OUT
#       every benchmark scenario (the tables of bench/RESULTS.md)
#   tools/gpu/run_gpu_checks.sh tests-builds-pairs OUT BASE_DIR [ROUNDS]
#       tests, memcheck, then bench/builds/batched_pairs built against an earlier commit's
#       library (BASE_DIR/batched_pairs) and against this one (build/batched_pairs),
#       alternating, ROUNDS (default 3) rounds each, then the batched benchmark (--quick)
#       and one run of the recorded traces' replay (three passes)
#   tools/gpu/run_gpu_checks.sh python OUT
#       the Python checks (plug-in build, PyTorch, CuPy), no torch_compare rounds
#   tools/gpu/run_gpu_checks.sh replay-torch-python OUT
#       builds the PyTorch plug-in and the Torch replay peer there (Torch exists only on that
#       machine), replays the recorded traces, runs the Python checks and torch_compare
#   tools/gpu/run_gpu_checks.sh tests-python OUT
#       tests, memcheck, the Python checks (no torch_compare rounds)
#   tools/gpu/run_gpu_checks.sh compare-pairs-batched OUT BASE_VRAM
#       the pairs and batched benchmarks of the `vram` binary BASE_VRAM (a build of an
#       earlier commit) and of build/vram, alternating, two rounds each, so both builds meet
#       the same card state
# Every log lands in OUT; OUT/results.tar.gz holds them all.
set -uo pipefail
mode=$1
out=$2
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
# The whole test binary (VRAM_REQUIRE_GPU=1) and memcheck over the GPU, device and stress
# tests (never death tests under compute-sanitizer: they fork).
tests_and_memcheck() {
  export VRAM_REQUIRE_GPU=1
  step tests 240 ./build/tests/vram_tests
  step memcheck 240 compute-sanitizer --tool memcheck --leak-check full --report-api-errors no \
    ./build/tests/vram_tests --gtest_filter='*Gpu*:*/device.*:*Stress*:-*DeathTest*' --gtest_brief=1
}
# Builds vram with the Torch replay peer there (Torch exists only on that machine).
torch_build() {
  local py=${PYTHON:-/opt/torch/.venv/bin/python3}
  local prefix
  prefix=$($py -c 'import torch;print(torch.utils.cmake_prefix_path)')
  step torch_build 300 bash -c "cmake -S . -B build-torch-replay -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DVRAM_BUILD_TESTS=OFF -DVRAM_BUILD_BENCH=OFF -DVRAM_TEST_KERNELS=OFF -DVRAM_WITH_TORCH=ON \
    -DCMAKE_PREFIX_PATH=$prefix && cmake --build build-torch-replay -j16 --target vram_cli"
}
# The recorded traces with PyTorch's allocator in the run.
torch_replay() {
  torch_build
  step replay_torch 300 ./build-torch-replay/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz \
    --json "$log/replay_torch.json"
}
# Synthetic multi-stream traces (tools/traces/stream_traces.py), every peer of the binary
# $1 (default: the one built with the Torch peer) in the run.
streams_replay() {
  local vram=${1:-./build-torch-replay/vram}
  step replay_streams 300 bash -c "python3 tools/traces/stream_traces.py $log/stream_traces && \
    $vram replay --runs 3 --passes 3 $log/stream_traces/streams1.csv \
    $log/stream_traces/streams4.csv $log/stream_traces/streams8.csv $log/stream_traces/streams16.csv \
    --json $log/replay_streams.json && \
    rm -r $log/stream_traces"
}
# Every benchmark scenario (the tables of bench/RESULTS.md).
full_bench() {
  step bench "$1" ./build/vram bench \
    --scenario pairs,threads,batched,mixed,replay,overhead,pagein,pinning,driver,pager \
    --json "$log/bench.json" --markdown "$log/bench.md" --svg "$log/bench.svg"
}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$log/gpu.txt" 2>&1
git log -1 --format='%H %cI' >"$log/commit.txt" 2>/dev/null || true

case $mode in
  tests-sanitizers-bench)
    tests_and_memcheck
    step racecheck 120 compute-sanitizer --tool racecheck ./build/tests/vram_tests \
      --gtest_filter='*Gpu*' --gtest_brief=1
    step racecheck_pager 150 compute-sanitizer --tool racecheck ./build/tests/vram_tests \
      --gtest_filter='WeightPagerGpu.*' --gtest_repeat=5 --gtest_brief=1
    step replay 240 ./build/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz --json "$log/replay.json"
    full_bench 400
    ;;
  tests-replay-streams-pairs)
    tests_and_memcheck
    torch_replay
    streams_replay
    step bench 300 ./build/vram bench --scenario pairs,batched \
      --json "$log/bench.json" --markdown "$log/bench.md"
    ;;
  tests-replay-bench)
    tests_and_memcheck
    torch_replay
    full_bench 400
    ;;
  tests-replay-streams)
    tests_and_memcheck
    step replay 240 ./build/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz \
      --json "$log/replay.json"
    streams_replay ./build/vram
    ;;
  tests-batched-pager)
    tests_and_memcheck
    step batched 200 ./build/vram bench --quick --scenario batched \
      --json "$log/batched.json" --markdown "$log/batched.md"
    step pager 200 ./build/vram bench --scenario pager --json "$log/pager.json" \
      --markdown "$log/pager.md"
    ;;
  tests-replay-batched-builds-pager)
    base=${3:?tests-replay-batched-builds-pager needs BASE_VRAM}
    tests_and_memcheck
    step replay 240 ./build/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz \
      --json "$log/replay.json"
    for round in 1 2; do
      step "base_batched_$round" 100 "$base" bench --quick --scenario batched \
        --json "$log/base_batched_$round.json"
      step "new_batched_$round" 100 ./build/vram bench --quick --scenario batched \
        --json "$log/new_batched_$round.json" --markdown "$log/new_batched_$round.md"
    done
    step pager 200 ./build/vram bench --scenario pager --json "$log/pager.json" \
      --markdown "$log/pager.md"
    ;;
  batched-rounds)
    base=${3:?batched-rounds needs BASE_VRAM}
    for round in $(seq 1 "${4:-5}"); do
      step "base_batched_$round" 60 "$base" bench --quick --scenario batched \
        --json "$log/base_batched_$round.json"
      step "new_batched_$round" 60 ./build/vram bench --quick --scenario batched \
        --json "$log/new_batched_$round.json"
    done
    ;;
  streams-torch)
    torch_build
    streams_replay
    ;;
  python-batched-builds)
    base=${3:?python-batched-builds needs BASE_VRAM}
    step torch_checks 300 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    step new_batched 150 ./build/vram bench --scenario batched --json "$log/new_batched.json" \
      --markdown "$log/new_batched.md"
    step base_batched 150 "$base" bench --scenario batched --json "$log/base_batched.json"
    ;;
  python-offload)
    py=${PYTHON:-/opt/torch/.venv/bin/python3}
    step torch_checks 300 env VRAM_TORCH_COMPARE=0 VRAM_TORCH_BUILD_DIR="$PWD/build-torch" \
      tests/python/run_all_on_gpu.sh "$log/torch"
    step offload_compare 330 env PYTHONPATH="$PWD/python:$PWD/tests/python" \
      VRAM_TORCH_LIB="$PWD/build-torch/plugins/torch/libvram_torch.so" \
      CUBLAS_WORKSPACE_CONFIG=:4096:8 "$py" bench/offload_compare.py "$log/offload" \
      --rows all_resident,vram_leaf,vram_leaf_depth1_third,vram_unit,vram_pageable,vram_everything_resident,accelerate
    ;;
  bench)
    full_bench 560
    ;;
  tests-replay-pairs-overhead)
    tests_and_memcheck
    torch_replay
    step bench 300 ./build/vram bench --scenario pairs,batched,overhead \
      --json "$log/bench.json" --markdown "$log/bench.md"
    ;;
  tests-replay-python)
    tests_and_memcheck
    torch_replay
    step torch_checks 420 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  tests-python)
    tests_and_memcheck
    step torch_checks 300 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  compare-pairs-batched)
    base=${3:?compare-pairs-batched needs BASE_VRAM}
    for round in 1 2; do
      step "base_pairs_batched_$round" 150 "$base" bench --scenario pairs,batched \
        --json "$log/base_pairs_batched_$round.json"
      step "new_pairs_batched_$round" 150 ./build/vram bench --scenario pairs,batched \
        --json "$log/new_pairs_batched_$round.json"
    done
    ;;
  tests-streams)
    tests_and_memcheck
    torch_build
    streams_replay
    ;;
  tests-builds-pairs)
    base=${3:?tests-builds-pairs needs BASE_DIR}
    tests_and_memcheck
    for round in $(seq 1 "${4:-3}"); do
      step "base_pairs_$round" 60 "$base/batched_pairs" base
      step "new_pairs_$round" 60 ./build/batched_pairs new
    done
    step batched 100 ./build/vram bench --quick --scenario batched \
      --json "$log/batched.json" --markdown "$log/batched.md"
    step replay 240 ./build/vram replay --runs 1 --passes 3 bench/traces/*.csv.gz \
      --json "$log/replay.json"
    ;;
  python)
    step torch_checks 420 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  replay-torch-python)
    torch_replay
    step torch_checks 420 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  *)
    echo "unknown mode '$mode' (see the comment at the top of $0)" >&2
    exit 2
    ;;
esac
tar czf "$out/results.tar.gz" -C "$out" logs
echo "== $mode done, status $status"
exit $status
