"""Segment events under vram_torch.enable(): every unit of memory vram reserves (a cudaMalloc
segment, a mapped run of virtual memory, a sleep tag's run) is a PyTorch segment, reported by
a segment_alloc trace event when it comes and a segment_free before it goes, to
_record_memory_history and to the allocator trace trackers (NCCL's registration hooks).

Checked by replaying the trace over the snapshot: starting from the segments of a first
snapshot, each segment_alloc adds a span no segment holds, each segment_free removes a span
exactly as it was added or listed, and the result is the segments of the last snapshot; the
events' bytes account for every change of memory_reserved and their counts for
num_device_alloc / num_device_free. A child process (segments_child.py) runs NCCL's
all_reduce with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 over tensors allocated after
init_process_group, across empty_cache, and checks the results and that no tracker failed;
once over virtual memory (where supported) and once over cudaMalloc segments
(VRAM_TORCH_VIRTUAL_MEMORY=0). The other tests run in the mode the environment selects.
"""
import gc
import json
import socket

import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

MODE = vram_torch.enable()
MiB = util.MiB


def _pieces(snapshot):
    """The snapshot's segments as sorted (address, size). One per unit of vram, cut further
    where a private pool's blocks begin or end (its pieces then follow each other)."""
    return sorted((s["address"], s["total_size"]) for s in snapshot["segments"])


def _merged(spans):
    out = []
    for address, size in sorted(spans):
        if out and out[-1][0] + out[-1][1] == address:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((address, size))
    return out


def _record(fn):
    """Runs fn() with history on; returns (first snapshot, trace, last snapshot, stats)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        before = torch.cuda.memory._snapshot()
        stats_before = torch.cuda.memory_stats()
        fn()
        torch.cuda.synchronize()
        after = torch.cuda.memory._snapshot()
        stats_after = torch.cuda.memory_stats()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    trace = [e for e in after["device_traces"][device]
             if e["action"] in ("segment_alloc", "segment_free", "segment_map",
                                "segment_unmap")]
    return before, trace, after, stats_before, stats_after


def _replay(before, trace, after):
    """Replays the segment events over the first snapshot; checks each against what is held
    and the result against the last snapshot."""
    held = {}  # units an event named: address -> size
    old = _pieces(before)  # units of the first snapshot, maybe cut in pieces
    for e in trace:
        assert e["action"] in ("segment_alloc", "segment_free"), e["action"]
        address, size = e["addr"], e["size"]
        assert size > 0, e
        if e["action"] == "segment_alloc":
            for a, n in list(held.items()) + old:
                assert address + size <= a or a + n <= address, \
                    f"segment_alloc {address:#x}+{size} overlaps {a:#x}+{n}"
            held[address] = size
        elif address in held:
            assert held.pop(address) == size, f"segment_free {address:#x}+{size}: other size"
        else:  # a unit of the first snapshot: its pieces tile the span exactly
            tiles = [(a, n) for a, n in old if address <= a < address + size]
            assert tiles and tiles[0][0] == address and _merged(tiles) == [(address, size)], \
                f"segment_free {address:#x}+{size} is no unit held: {tiles[:4]}"
            old = [t for t in old if t not in tiles]
    now = _pieces(after)
    starts = {a for a, _ in now}
    for address, size in held.items():
        assert address in starts, f"unit {address:#x} from an event is no snapshot segment"
        tiles = [(a, n) for a, n in now if address <= a < address + size]
        assert _merged(tiles) == [(address, size)], f"unit {address:#x}+{size}: {tiles[:4]}"
    rest = [(a, n) for a, n in now
            if not any(u <= a < u + m for u, m in held.items())]
    assert _merged(rest) == _merged(old), (_merged(rest)[:4], _merged(old)[:4])


def _check(before, trace, after, stats_before, stats_after, counted=True):
    """counted: the events are the pool's tiers' (num_device_alloc / num_device_free count
    them); a sleep tag's maps and unmaps are not counted there."""
    _replay(before, trace, after)
    allocs = [e for e in trace if e["action"] == "segment_alloc"]
    frees = [e for e in trace if e["action"] == "segment_free"]
    grown = sum(e["size"] for e in allocs) - sum(e["size"] for e in frees)
    assert grown == (stats_after["reserved_bytes.all.current"]
                     - stats_before["reserved_bytes.all.current"]), grown
    if counted:
        assert len(allocs) == stats_after["num_device_alloc"] - stats_before["num_device_alloc"]
        assert len(frees) == stats_after["num_device_free"] - stats_before["num_device_free"]
    assert sum(s["total_size"] for s in after["segments"]) == stats_after[
        "reserved_bytes.all.current"]
    return allocs, frees


def _grow_pool(times=1):
    """Tensors allocated until the pool grew `times` times (cached memory may serve the
    first ones)."""
    start = torch.cuda.memory_stats()["num_device_alloc"]
    kept = []
    for _ in range(64):
        kept.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
        if torch.cuda.memory_stats()["num_device_alloc"] >= start + times:
            return kept
    raise AssertionError("64 tensors of 64 MiB did not grow the pool")


def test_enable_is_native():
    assert MODE == "native", MODE


def test_growth_makes_segment_alloc_and_empty_cache_segment_free():
    torch.cuda.empty_cache()
    kept = []

    def grow():
        for n in [3000, 700 * 1024, 3 * MiB, 24 * MiB]:
            kept.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        kept.extend(_grow_pool(2))

    allocs, frees = _check(*_record(grow))
    assert len(allocs) >= 2, allocs
    streams = {e["stream"] for e in allocs}
    assert torch.cuda.current_stream().cuda_stream in streams, streams

    def shrink():
        kept.clear()
        gc.collect()
        torch.cuda.empty_cache()

    allocs, frees = _check(*_record(shrink))
    assert len(frees) >= 1, "empty_cache gave nothing back"
    assert not allocs, allocs


def test_segment_events_carry_the_stacks_pytorch_records():
    """As PyTorch's: a segment_alloc carries the stack of the request that grew the pool; a
    segment_free of empty_cache carries empty_cache's stack with context="all" only."""
    for context in ("alloc", "all"):
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(context=context)
        try:
            x = _grow_pool()
            del x
            torch.cuda.empty_cache()
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        allocs = [e for e in trace if e["action"] == "segment_alloc"]
        frees = [e for e in trace if e["action"] == "segment_free"]
        assert allocs and frees, [e["action"] for e in trace][-10:]
        assert all(e.get("frames") for e in allocs), context
        # PyTorch leaves "frames" out of an entry that has none.
        in_frees = "empty_cache" in json.dumps([e.get("frames", []) for e in frees])
        assert in_frees == (context == "all"), (context, frees[-1].get("frames", [])[:3])


def test_private_pool_blocks_keep_events_whole():
    pool = torch.cuda.MemPool()
    held = []

    def use_pool():
        with torch.cuda.use_mem_pool(pool):
            held.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
        held.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
        with torch.cuda.use_mem_pool(pool):
            held.append(torch.empty(5000, dtype=torch.uint8, device="cuda"))

    _check(*_record(use_pool))
    in_pool = {s["address"] for s in torch.cuda.memory.memory_snapshot(pool.id)}
    assert held[0].data_ptr() in in_pool and held[2].data_ptr() in in_pool

    def release():
        held.clear()
        gc.collect()
        torch.cuda.empty_cache()

    _check(*_record(release))
    del pool
    gc.collect()
    _check(*_record(torch.cuda.empty_cache))


def test_sleep_gives_back_with_segment_free_and_wake_maps_with_segment_alloc():
    with vram_torch.region("t_segments"):
        x = torch.full((48 * MiB // 4,), 3.0, device="cuda")
    torch.cuda.synchronize()

    def sleep():
        vram_torch.sleep("t_segments")

    _, frees = _check(*_record(sleep), counted=False)
    assert frees, "sleep gave nothing back"

    def wake():
        vram_torch.wake("t_segments")

    allocs, _ = _check(*_record(wake), counted=False)
    assert allocs, "wake mapped nothing"
    assert x.sum().item() == 3.0 * x.numel()
    del x
    gc.collect()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _nccl_child(env):
    proc = util.run_child("segments_child.py", _free_port(), timeout=300, env=env)
    row = util.child_result(proc, env)
    assert "trace tracker failed" not in proc.stderr, proc.stderr[-3000:]
    assert row["mode"] == "native"
    assert row["wrong"] == 0, row
    assert row["segment_alloc_after_init"] > 0, row
    assert row["segment_free"] > 0, row
    assert "tracker" not in row["last_error"], row["last_error"]


def test_nccl_registered_all_reduce_over_memory_grown_after_init():
    _nccl_child(None)  # virtual memory where the device supports it


def test_nccl_registered_all_reduce_over_cudamalloc_segments():
    _nccl_child({"VRAM_TORCH_VIRTUAL_MEMORY": "0"})


if __name__ == "__main__":
    util.run_tests(globals())
