#!/usr/bin/env bash
# The GPU machine's part of a session (docs/GPU-STATUS.md): run from the repository root on
# the H200 with the Release build from the build machine carried in build/.
#   tools/gpu/h200_run.sh cxx   OUT   tests, compute-sanitizer, replay, benchmarks
#   tools/gpu/h200_run.sh core  OUT   tests, memcheck (never death tests: they fork; a
#                                     memcheck run with one did not finish in session 5), replay
#                                     with the Torch peer (built there), of the recorded and of
#                                     the synthetic multi-stream traces,
#                                     pairs and batched benchmarks: one call per session
#   tools/gpu/h200_run.sh final OUT   tests, memcheck, replay with the Torch peer, the full run
#   tools/gpu/h200_run.sh check OUT   tests, memcheck, the stream traces with the Torch peer
#   tools/gpu/h200_run.sh review OUT  tests, memcheck, replay with the Torch peer, pairs,
#                                     batched and overhead benchmarks
#   tools/gpu/h200_run.sh closing OUT tests, memcheck, replay with the Torch peer, Python checks
#   tools/gpu/h200_run.sh full  OUT   the full benchmark run (every scenario; the tables of
#                                     bench/RESULTS.md's "Latest full run" and its headline)
#   tools/gpu/h200_run.sh py    OUT   the Python checks (plug-in build, PyTorch, CuPy), no
#                                     torch_compare rounds
#   tools/gpu/h200_run.sh torch OUT   builds the PyTorch plug-in and the Torch replay peer
#                                     there (Torch exists only on that machine), runs them
# Every log lands in OUT; OUT/results.tar.gz holds them all (the device tool returns few files).
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
# Synthetic multi-stream traces (tools/traces/stream_traces.py), every peer in the run.
streams_replay() {
  step replay_streams 300 bash -c "python3 tools/traces/stream_traces.py $log/stream_traces && \
    ./build-torch-replay/vram replay --runs 3 --passes 3 $log/stream_traces/streams1.csv \
    $log/stream_traces/streams4.csv $log/stream_traces/streams8.csv $log/stream_traces/streams16.csv \
    --json $log/replay_streams.json && \
    rm -r $log/stream_traces"
}
# Every benchmark scenario (bench/RESULTS.md's "Latest full run" and its headline).
full_bench() {
  step bench "$1" ./build/vram bench \
    --scenario pairs,threads,batched,mixed,replay,overhead,pagein,pinning,driver,pager \
    --json "$log/bench.json" --markdown "$log/bench.md" --svg "$log/bench.svg"
}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$log/gpu.txt" 2>&1
git log -1 --format='%H %cI' >"$log/commit.txt" 2>/dev/null || true

case $mode in
  cxx)
    tests_and_memcheck
    step racecheck 120 compute-sanitizer --tool racecheck ./build/tests/vram_tests \
      --gtest_filter='*Gpu*' --gtest_brief=1
    step racecheck_pager 150 compute-sanitizer --tool racecheck ./build/tests/vram_tests \
      --gtest_filter='WeightPagerGpu.*' --gtest_repeat=5 --gtest_brief=1
    step replay 240 ./build/vram replay --runs 3 --passes 3 bench/traces/*.csv.gz --json "$log/replay.json"
    full_bench 400
    ;;
  core)  # a session's GPU check in one call: tests, memcheck, replay with PyTorch, pairs
    tests_and_memcheck
    torch_replay
    streams_replay
    step bench 300 ./build/vram bench --scenario pairs,batched \
      --json "$log/bench.json" --markdown "$log/bench.md"
    ;;
  final)  # the last call of a session: tests, memcheck, replay with PyTorch, the full run
    tests_and_memcheck
    torch_replay
    full_bench 400
    ;;
  full)
    full_bench 560
    ;;
  review)  # after bad-input fixes on the hot paths: tests, memcheck, replay with PyTorch,
    # the pair, batched and StreamOrderedPool-overhead benchmarks
    tests_and_memcheck
    torch_replay
    step bench 300 ./build/vram bench --scenario pairs,batched,overhead \
      --json "$log/bench.json" --markdown "$log/bench.md"
    ;;
  closing)  # the last call after bad-input fixes: tests, memcheck, replay with PyTorch, the
    # Python checks (plug-in built there, PyTorch and CuPy)
    tests_and_memcheck
    torch_replay
    step torch_checks 420 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  check)  # after a change late in a session: tests, memcheck, the stream traces with PyTorch
    tests_and_memcheck
    torch_build
    streams_replay
    ;;
  py)
    step torch_checks 420 env VRAM_TORCH_COMPARE=0 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
  torch)
    torch_replay
    step torch_checks 420 tests/python/run_all_on_gpu.sh "$log/torch"
    ;;
esac
tar czf "$out/results.tar.gz" -C "$out" logs
echo "== $mode done, status $status"
exit $status
