"""vram as PyTorch's own CUDA allocator (vram_torch.enable() with a library built against
Torch): torch.cuda's memory calls over vram's pools.

Figures are checked against vram's own counters and against what the test allocated
(differences), never against hard-coded totals: PyTorch allocates workspaces of its own.
"""
import gc
import json
import os
import tempfile

import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

MODE = vram_torch.enable()
MiB = util.MiB


def _agree_with_vram():
    """torch.cuda's figures equal vram_torch.stats() read at the same moment."""
    torch.cuda.synchronize()
    v = vram_torch.stats()
    t = torch.cuda.memory_stats()
    assert torch.cuda.memory_allocated() == v["allocated_bytes.all.current"]
    assert torch.cuda.max_memory_allocated() == v["allocated_bytes.all.peak"]
    assert torch.cuda.memory_reserved() == v["reserved_bytes.all.current"]
    assert torch.cuda.max_memory_reserved() == v["reserved_bytes.all.peak"]
    assert t["requested_bytes.all.current"] == v["requested_bytes.all.current"]
    assert t["allocation.all.current"] == v["allocation.all.current"]
    assert t["num_device_alloc"] == v["num_device_alloc"]
    assert t["num_ooms"] == v["num_ooms"]
    assert t["allocated_bytes.all.current"] == (t["allocated_bytes.small_pool.current"]
                                               + t["allocated_bytes.large_pool.current"])
    return t


def test_enable_installs_vram_as_pytorchs_own_allocator():
    assert MODE == "native", MODE
    assert torch.cuda.memory.get_allocator_backend() == "vram"


def test_memory_calls_agree_with_vram_through_training_steps():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    peaks = []
    for step in range(4):
        x = torch.randn(8, 64 + 16 * step, 256, device="cuda")  # a fresh shape each step
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = _agree_with_vram()
        peaks.append(stats["allocated_bytes.all.peak"])
        assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
        assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    assert peaks == sorted(peaks), peaks  # longer sequences need more
    before = torch.cuda.memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] == 0 and after["allocated_bytes.all.freed"] == 0
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]


def test_counters_follow_a_tensor_exactly():
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    x = torch.empty(5 * MiB + 3, dtype=torch.uint8, device="cuda")
    during = torch.cuda.memory_stats()
    assert during["requested_bytes.all.current"] - before["requested_bytes.all.current"] \
        == 5 * MiB + 3
    assert during["allocated_bytes.large_pool.current"] \
        - before["allocated_bytes.large_pool.current"] == vram_torch.block_bytes(5 * MiB + 3)
    assert during["allocation.all.allocated"] - before["allocation.all.allocated"] == 1
    del x
    after = torch.cuda.memory_stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["allocation.all.freed"] - before["allocation.all.freed"] == 1


def test_snapshot_shows_vram_segments_and_memory_viz_renders_it():
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3000, 2 * MiB, 40 * MiB)]
        gone = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        del gone
        snap = torch.cuda.memory._snapshot()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            assert os.path.getsize(path) > 0
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    segments = snap["segments"]
    assert segments, "no segments"
    reserved = sum(s["total_size"] for s in segments)
    print(f"snapshot: {len(segments)} segments, {reserved} bytes; reserved "
          f"{torch.cuda.memory_reserved()}")
    assert reserved <= torch.cuda.memory_reserved()
    addresses = {}
    for s in segments:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"], s["address"]
        at = s["address"]
        for b in s["blocks"]:
            addresses[at] = b
            at += b["size"]
    for t in keep:
        b = addresses.get(t.data_ptr())
        assert b is not None and b["state"] == "active_allocated", (t.numel(), b)
        assert b["frames"], "no stack recorded for a live block"
        # A block that spans two units (mapped runs) is cut at the run's end: each piece
        # carries the requested bytes that lie in it, so the pieces add up to the request.
        at, requested = t.data_ptr(), 0
        while b is not None and b["state"] == "active_allocated" and requested < t.numel():
            requested += b["requested_size"]
            if b["requested_size"] < b["size"]:
                break
            at += b["size"]
            b = addresses.get(at)
        assert requested == t.numel(), (t.numel(), requested)
    trace = snap["device_traces"][torch.cuda.current_device()]
    actions = [e["action"] for e in trace]
    assert "alloc" in actions and "free_completed" in actions, actions[-10:]
    frees = [e for e in trace if e["action"] == "free_requested"]
    assert frees and frees[-1]["size"] == 8 * MiB  # PyTorch's trace: the requested size
    html = _memory_viz.trace_plot(snap)
    assert "<html" in html.lower() and len(html) > 1000
    assert _memory_viz.segment_plot(snap)
    assert "segment" in _memory_viz.segsum(snap).lower()
    del keep


def _free_block_at(snap, address):
    """The inactive block of `snap` that holds `address` (None: none); every inactive block's
    requested bytes checked to lie within it."""
    found = None
    for s in snap["segments"]:
        at = s["address"]
        for b in s["blocks"]:
            if b["state"] == "inactive":
                assert b["requested_size"] <= b["size"], (b["requested_size"], b["size"])
                if at <= address < at + b["size"]:
                    found = b
            at += b["size"]
    return found


def test_snapshot_names_the_last_request_of_free_memory_as_pytorch_does():
    # PyTorch's snapshot keeps a freed tensor's requested bytes on the free block it leaves;
    # its test_memory_plots searches the snapshot's text for them after rendering it.
    from torch.cuda import _memory_viz

    odd = 70001  # no size class or rounding of either allocator
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        keep = torch.empty(4096, dtype=torch.uint8, device="cuda")
        gone = torch.empty(odd, dtype=torch.uint8, device="cuda")
        address = gone.data_ptr()
        del gone
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found = _free_block_at(snap, address)
    assert found is not None, "the freed tensor's memory is in no free block"
    assert found["requested_size"] == odd, found
    assert "<html" in _memory_viz.trace_plot(snap).lower()
    # PyTorch's test searches the text after its trace filter dropped the freed pair: here the
    # segments alone, without the trace.
    assert str(odd) in json.dumps(snap["segments"])
    assert "segment" in _memory_viz.segsum(snap).lower()
    # A difference: turned off, vram's history forgets its frees (frees while it is off are not
    # recorded, so older records could name memory used since); PyTorch's blocks keep theirs.
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        again = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found = _free_block_at(again, address)
    assert found is not None and found["requested_size"] == 0, found
    del keep


def test_mem_pool_keeps_its_blocks_and_counts_its_uses():
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        x = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(1000, dtype=torch.uint8, device="cuda")
    z = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")  # not the pool's
    assert pool.use_count() == 1
    segments = torch.cuda.memory.memory_snapshot(pool.id)
    in_pool = {s["address"] for s in segments}
    assert x.data_ptr() in in_pool and y.data_ptr() in in_pool and z.data_ptr() not in in_pool
    x_ptr = x.data_ptr()
    del x
    with torch.cuda.use_mem_pool(pool):
        x2 = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    assert x2.data_ptr() == x_ptr, "a freed block of the pool is its own to reuse"
    w = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    assert w.data_ptr() != x_ptr
    del x2, y, z, w, pool
    gc.collect()
    torch.cuda.empty_cache()
    _agree_with_vram()


def _blocks_of(segments):
    """{block address: (block, its segment)} of a snapshot's segments."""
    found = {}
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            found[address] = (block, segment)
            address += block["size"]
    return found


def test_snapshot_lists_a_private_pools_free_blocks_as_its_own_with_their_stream():
    # A private pool keeps its freed blocks for its own next allocations: a snapshot lists
    # them in the pool's segments, free, with the stream they were allocated on (as PyTorch lists
    # a private pool's cached blocks); once the pool is gone they are no pool's.
    pool = torch.cuda.MemPool()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(1000, dtype=torch.uint8, device="cuda")
    x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
    del x
    torch.cuda.empty_cache()  # a pool with a use keeps its free blocks
    in_pool = _blocks_of(torch.cuda.memory.memory_snapshot(pool.id))
    assert x_ptr in in_pool and y_ptr in in_pool
    x_block, x_segment = in_pool[x_ptr]
    assert x_block["state"] == "inactive" and x_block["size"] >= 3 * MiB
    assert tuple(x_segment["segment_pool_id"]) == tuple(pool.id)
    assert x_segment["stream"] == side.cuda_stream
    assert in_pool[y_ptr][0]["state"] == "active_allocated"
    everything = _blocks_of(torch.cuda.memory_snapshot())
    assert tuple(everything[x_ptr][1]["segment_pool_id"]) == tuple(pool.id), \
        "the whole snapshot names the pool too"
    with torch.cuda.use_mem_pool(pool):
        x2 = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    assert x2.data_ptr() == x_ptr
    assert _blocks_of(torch.cuda.memory.memory_snapshot(pool.id))[x_ptr][0]["state"] == \
        "active_allocated"
    # A shared tensor freed inside use_mem_pool (no capture) goes back where it came from.
    shared = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    shared_ptr = shared.data_ptr()
    with torch.cuda.use_mem_pool(pool):
        del shared
    assert shared_ptr not in _blocks_of(torch.cuda.memory.memory_snapshot(pool.id))
    again = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    assert again.data_ptr() == shared_ptr, "the shared block is free to a request outside the pool"
    pool_id = tuple(pool.id)
    del x2, y, pool, again
    gc.collect()
    torch.cuda.empty_cache()
    assert not [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool_id]

    # A CUDA graph's pool: the blocks its capture freed are the pool's, on the capture's
    # stream (what CUDA graph trees read: one stream per pool).
    graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    a = torch.ones(MiB, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=capture):
        tmp = a * 2
        out = tmp + 1
        del tmp
    graph.replay()
    torch.cuda.synchronize()
    assert float(out.sum()) == 3 * MiB
    segments = torch.cuda.memory.memory_snapshot(graph.pool())
    states = [b["state"] for s in segments for b in s["blocks"]]
    assert "inactive" in states and "active_allocated" in states, states
    assert {s["stream"] for s in segments} == {capture.cuda_stream}
    graph_pool = tuple(graph.pool())
    del out, graph
    gc.collect()
    torch.cuda.empty_cache()
    assert not [s for s in torch.cuda.memory_snapshot()
                if tuple(s["segment_pool_id"]) == graph_pool]
    _agree_with_vram()


def test_a_shared_tensor_freed_inside_a_capture_of_its_stream_becomes_the_graphs():
    # Allocated on the capture's stream before the capture and freed inside it: the graph
    # reads it at every launch, so its block is the graph pool's (listed there, free) and no
    # request outside the pool gets it while the graph lives.
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):
        x = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")
    x_ptr = x.data_ptr()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        y = x + 1
        del x
    blocks = _blocks_of(torch.cuda.memory.memory_snapshot(graph.pool()))
    assert x_ptr in blocks and blocks[x_ptr][0]["state"] == "inactive"
    assert blocks[x_ptr][1]["stream"] == capture.cuda_stream
    z = torch.zeros(3 * MiB, dtype=torch.uint8, device="cuda")
    assert z.data_ptr() != x_ptr
    graph.replay()
    torch.cuda.synchronize()
    assert int(y.sum()) == 2 * 3 * MiB and int(z.sum()) == 0
    del y, z, graph
    gc.collect()
    torch.cuda.empty_cache()
    _agree_with_vram()


def test_mem_pool_with_its_own_allocator_takes_blocks_from_it():
    # A pluggable allocator over vram's C interface stands for any foreign one (NCCL's, ...).
    # Its segments are then vram's memory too: while they live, the reserved bytes and device
    # allocations count them twice (once as vram's, once as the pool's), in both views.
    other = torch.cuda.memory.CUDAPluggableAllocator(
        vram_torch.library_path(), "vram_torch_alloc", "vram_torch_free")
    pool = torch.cuda.MemPool(other.allocator())
    before = vram_torch.stats()["allocation.all.allocated"]
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(4 * MiB, device="cuda")
    # Counted twice: once by PyTorch's call of the foreign allocator (which is vram's C
    # interface here), once as an allocation of the pool.
    assert vram_torch.stats()["allocation.all.allocated"] - before == 2
    assert float(x.sum()) == 4 * MiB
    del x, pool
    gc.collect()
    _agree_with_vram()


_PLAIN_ALLOCATOR_C = r"""
#include <stddef.h>
int cudaMalloc(void** ptr, size_t size);
int cudaFree(void* ptr);
int plain_allocs = 0, plain_frees = 0;
void* plain_alloc(size_t size, int device, void* stream) {
  void* ptr = 0;
  if (cudaMalloc(&ptr, size) != 0) return 0;
  ++plain_allocs;
  return ptr;
}
void plain_free(void* ptr, size_t size, int device, void* stream) {
  ++plain_frees;
  cudaFree(ptr);
}
"""


def _plain_cuda_allocator(folder):
    """A MemPool allocator of cudaMalloc and cudaFree (as PyTorch's own tests make one), and
    its counters."""
    import ctypes
    import subprocess
    from torch.utils.cpp_extension import CUDA_HOME
    assert CUDA_HOME, "no CUDA toolkit found to build the test's allocator"
    source = os.path.join(folder, "plain_allocator.c")
    library = os.path.join(folder, "plain_allocator.so")
    with open(source, "w") as f:
        f.write(_PLAIN_ALLOCATOR_C)
    libs = [d for d in (os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib"))
            if os.path.isdir(d)]
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", source, "-o", library]
                   + ["-L" + d for d in libs] + ["-lcudart"]
                   + ["-Wl,-rpath," + d for d in libs], check=True)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library, "plain_alloc", "plain_free")
    lib = ctypes.CDLL(library)
    return (allocator, ctypes.c_int.in_dll(lib, "plain_allocs"),
            ctypes.c_int.in_dll(lib, "plain_frees"))


def test_mem_pool_with_its_own_allocator_caches_segments_as_pytorch_does():
    # PyTorch's packing: tensors of up to 1 MiB share 2 MiB segments of the pool's allocator,
    # which stay the pool's (listed by its snapshot, kept by empty_cache while it has a use)
    # and go back to that allocator when its last use and block are gone.
    folder = tempfile.TemporaryDirectory()
    allocator, allocs, frees = _plain_cuda_allocator(folder.name)
    reserved_before = torch.cuda.memory_reserved()
    stats_before = torch.cuda.memory_stats()
    pool = torch.cuda.MemPool(allocator.allocator())
    nelem_1mb = MiB // 4
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        with torch.cuda.use_mem_pool(pool):
            a = torch.randn(nelem_1mb, device="cuda")
            assert len(pool.snapshot()) == 1
            b = torch.randn(nelem_1mb, device="cuda")
            assert len(pool.snapshot()) == 1
            c = torch.randn(nelem_1mb, device="cuda")
            assert len(pool.snapshot()) == 2
        assert allocs.value == 2
        segments = pool.snapshot()
        assert [s["total_size"] for s in segments] == [2 * MiB, 2 * MiB]
        assert all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segments)
        assert sum(s["allocated_size"] for s in segments) == 3 * MiB
        assert segments[0]["address"] < segments[1]["address"], "by address, as PyTorch's"
        starts = {s["address"] for s in segments}
        assert a.data_ptr() in starts and c.data_ptr() in starts
        assert b.data_ptr() == a.data_ptr() + MiB
        assert torch.cuda.memory_reserved() - reserved_before >= 4 * MiB  # the two segments
        _agree_with_vram()  # both views count the pool's segments
        stats = torch.cuda.memory_stats()  # the segments count as PyTorch counts them
        assert stats["num_device_alloc"] - stats_before["num_device_alloc"] >= 2
        assert stats["segment.all.current"] - stats_before["segment.all.current"] >= 2
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        made = [e for e in trace if e["action"] == "segment_alloc" and e["addr"] in starts]
        assert len(made) == 2 and all(e["size"] == 2 * MiB for e in made), made
        del a, b, c
        torch.cuda.empty_cache()  # a pool with a use keeps its cached segments
        assert len(pool.snapshot()) == 2 and frees.value == 0
        with torch.cuda.use_mem_pool(pool):
            d = torch.ones(nelem_1mb, device="cuda")
        assert d.data_ptr() in starts, "a cached segment of the pool serves it"
        assert len(pool.snapshot()) == 2 and allocs.value == 2
        assert float(d.cpu().sum()) == nelem_1mb  # no block of vram's for the sum
        del d, pool
        gc.collect()
        assert frees.value == 2
        assert (torch.cuda.memory_stats()["num_device_free"]
                - stats_before["num_device_free"]) >= 2
        all_segments = torch.cuda.memory._snapshot()
        assert not any(s["address"] in starts for s in all_segments["segments"])
        freed = [e for e in all_segments["device_traces"][torch.cuda.current_device()]
                 if e["action"] == "segment_free" and e["addr"] in starts]
        assert len(freed) == 2, freed
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.cuda.memory_reserved() <= reserved_before


def test_mem_pool_with_its_own_allocator_holds_a_recorded_block_back_without_waiting():
    # A block of such a pool used on another stream (record_stream) returns to the pool once
    # that stream's work at the free has run, not before; the free itself does not wait.
    # 11 MiB: the block is its whole 12 MiB segment (a rest of 1 MiB is not cut off), so the
    # held block counts the bytes its allocation counted, not the request rounded.
    folder = tempfile.TemporaryDirectory()
    allocator, allocs, frees = _plain_cuda_allocator(folder.name)
    pool = torch.cuda.MemPool(allocator.allocator())
    side = torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(11 * MiB, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    assert [s["total_size"] for s in pool.snapshot()] == [12 * MiB]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(util.SLEEP_CYCLES)
        x.fill_(3)
    x.record_stream(side)
    active = torch.cuda.memory_stats()["active_bytes.all.current"]
    allocated = torch.cuda.memory_allocated()
    held = vram_torch.stats()["vram.held_back_bytes"]
    del x
    assert not side.query(), "the free waited for the recorded stream"
    assert torch.cuda.memory_stats()["active_bytes.all.current"] == active, (
        "a block held back for its recorded stream is still active (PyTorch's meaning)")
    assert torch.cuda.memory_allocated() == allocated - 12 * MiB
    assert vram_torch.stats()["vram.held_back_bytes"] == held + 12 * MiB
    blocks = [b for s in pool.snapshot() for b in s["blocks"]]
    assert [b["state"] for b in blocks] == ["active_pending_free"], blocks
    with torch.cuda.use_mem_pool(pool):
        y = torch.empty(11 * MiB, dtype=torch.uint8, device="cuda")
    assert y.data_ptr() != ptr, "a block used by a running stream was handed out again"
    assert allocs.value == 2
    side.synchronize()
    del y
    with torch.cuda.use_mem_pool(pool):
        z = torch.ones(11 * MiB, dtype=torch.uint8, device="cuda")
    # The held block went back to its pool once the stream had run: both segments' blocks
    # are the pool's again, one of them serves z, no third segment.
    states = sorted(b["state"] for s in pool.snapshot() for b in s["blocks"])
    assert states == ["active_allocated", "inactive"], states
    assert allocs.value == 2
    assert vram_torch.stats()["vram.held_back_bytes"] == 0
    del z, pool
    gc.collect()
    assert frees.value == 2


def test_mem_pool_with_its_own_allocator_releases_a_block_recorded_in_a_capture_after_it():
    # Freed inside a capture with a recorded stream that is captured too: its event is
    # recorded once the capture has ended (never a node of the graph), then the block goes
    # back to its pool; the capture stays valid.
    folder = tempfile.TemporaryDirectory()
    allocator, allocs, frees = _plain_cuda_allocator(folder.name)
    pool = torch.cuda.MemPool(allocator.allocator())
    graph = torch.cuda.CUDAGraph()
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(main):
        graph.capture_begin(pool=pool.id)
        x = torch.ones(MiB, dtype=torch.uint8, device="cuda")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = x + 1
            x.record_stream(side)
        del x
        main.wait_stream(side)
        graph.capture_end()
    assert vram_torch.stats()["vram.held_back_blocks"] >= 1
    states = sorted(b["state"] for s in pool.snapshot() for b in s["blocks"])
    assert "active_pending_free" in states, states
    graph.replay()
    torch.cuda.synchronize()
    assert int(y.sum()) == 2 * MiB
    # An allocation records the side stream's event now that its capture has ended; one
    # after that stream has run finds the event complete and the block back in its pool.
    first = torch.empty(16, device="cuda")
    side.synchronize()
    second = torch.empty(16, device="cuda")
    assert vram_torch.stats()["vram.held_back_blocks"] == 0
    del first, second, y, graph
    gc.collect()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    assert frees.value == allocs.value


def test_a_block_used_on_a_captured_side_stream_is_not_reused_within_the_capture():
    # A graph's block used by a captured side stream (record_stream) and freed before the
    # join is not handed out again in the same capture: the graph would order nothing
    # between the side stream's read and the new tensor's writes.
    graph = torch.cuda.CUDAGraph()
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(main):
        graph.capture_begin()
        x = torch.ones(MiB, dtype=torch.uint8, device="cuda")
        x_ptr = x.data_ptr()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = x + 1
            x.record_stream(side)
        del x
        z = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        z.fill_(7)
        main.wait_stream(side)
        graph.capture_end()
    assert z.data_ptr() != x_ptr, "a block a captured stream still reads was handed out again"
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(y.sum()) == 2 * MiB and int(z.sum()) == 7 * MiB
    del y, z, graph
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # records the side stream's event, waits, and gives x's block back
    assert vram_torch.stats()["vram.held_back_blocks"] == 0


def test_memory_fraction_raises_out_of_memory_past_it_and_stays_usable():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25)
    try:
        assert abs(torch.cuda.get_per_process_memory_fraction() - 0.25) < 1e-9
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(
            lambda device, alloc, device_alloc, device_free: seen.append(device))
        ooms = torch.cuda.memory_stats()["num_ooms"]
        try:
            torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
            raise AssertionError("no out-of-memory error past the fraction")
        except torch.OutOfMemoryError as e:
            assert "CUDA out of memory" in str(e) and "memory_fraction" in str(e), str(e)
        assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1
        assert seen == [0], seen
        ok = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        ok.fill_(1)
        del ok
        torch.cuda.set_per_process_memory_fraction(0.0)  # nothing more may be allocated
        try:
            torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            raise AssertionError("an allocation passed a fraction of 0")
        except torch.OutOfMemoryError:
            pass
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_raw_alloc_raw_delete_and_caching_allocator_calls():
    stream = torch.cuda.current_stream().cuda_stream
    ptr = torch.cuda.caching_allocator_alloc(3 * MiB, stream=stream)
    assert ptr != 0
    assert torch.cuda.memory_stats()["requested_bytes.all.current"] >= 3 * MiB
    torch.cuda.caching_allocator_delete(ptr)
    try:
        torch.cuda.caching_allocator_delete(ptr)  # a double free is refused
        raise AssertionError("a second delete of the same pointer was accepted")
    except RuntimeError as e:
        assert "invalid device pointer" in str(e), str(e)
    _agree_with_vram()


def test_record_stream_delays_reuse_until_the_stream_has_run():
    side = torch.cuda.Stream()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    with torch.cuda.stream(side):
        torch.cuda._sleep(util.SLEEP_CYCLES)
        x.fill_(3)
    x.record_stream(side)
    del x
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert y.data_ptr() != ptr, "a block used by a running stream was handed out again"
    torch.cuda.synchronize()
    del y


def test_snapshot_shows_a_block_held_for_its_recorded_stream_as_pending_free():
    # Freed while a recorded stream's work still runs, a block stays its pool's: the snapshot
    # lists it active and not allocated (PyTorch's "active_pending_free") in its pool's
    # segment, the shared pool's or a MemPool's, and memory_stats counts it active.
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    for owner in (None, pool):
        torch.cuda.synchronize()
        if owner is None:
            x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        else:
            with torch.cuda.use_mem_pool(owner):
                x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        ptr, want = x.data_ptr(), (0, 0) if owner is None else tuple(owner.id)
        active_before = torch.cuda.memory_stats()["active_bytes.all.current"]
        with torch.cuda.stream(side):
            torch.cuda._sleep(util.SLEEP_CYCLES)
            x.fill_(3)
        x.record_stream(side)
        del x
        block, segment = _blocks_of(torch.cuda.memory_snapshot())[ptr]
        assert block["state"] == "active_pending_free", (owner, block)
        assert tuple(segment["segment_pool_id"]) == want
        assert segment["active_size"] - segment["allocated_size"] >= block["size"]
        assert torch.cuda.memory_stats()["active_bytes.all.current"] == active_before
        side.synchronize()
        torch.cuda.empty_cache()  # releases what was held back once its streams' work is done
        after = _blocks_of(torch.cuda.memory_snapshot()).get(ptr)
        assert after is None or after[0]["state"] == "inactive", after
    del pool
    gc.collect()


def test_accelerator_memory_calls_read_vram():
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    acc = torch.accelerator.memory_stats()
    cuda = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "active_bytes.all.current",
                "requested_bytes.all.current", "reserved_bytes.all.current"):
        assert acc[key] == cuda[key], key
    assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated()
    del x


def test_out_of_memory_message_and_observers_for_any_size():
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
    with _raises(torch.OutOfMemoryError) as message:
        torch.empty(1024 * 1024 * 1024 * 1024, device="cuda")  # 4 TiB: beyond any block
    assert "Tried to allocate 4096.00 GiB. GPU " in message[0], message[0]
    assert "has a total capacity of" in message[0], message[0]
    assert seen and seen[-1][0] == torch.cuda.current_device(), seen


def test_history_skips_actions_carries_context_and_is_emptied_when_turned_off():
    torch.cuda.memory._record_memory_history(context="all", skip_actions=["free_completed"])
    try:
        torch.cuda.memory._set_memory_metadata("step 7")
        x = torch.empty(MiB + 5, dtype=torch.uint8, device="cuda")
        del x
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._set_memory_metadata("")
        torch.cuda.memory._record_memory_history(enabled=None)
    actions = [e["action"] for e in trace]
    assert "free_requested" in actions and "free_completed" not in actions, actions
    alloc = [e for e in trace if e["action"] == "alloc"][-1]
    assert alloc["size"] == MiB + 5, alloc["size"]
    assert alloc["user_metadata"] == "step 7" and alloc["compile_context"] == "N/A", alloc
    # Turned off, the trace is empty (PyTorch's rule): the next recording starts afresh.
    torch.cuda.memory._record_memory_history(context="all")
    try:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert not [e for e in trace if e["action"] == "free_requested"], trace[:5]


def test_free_entries_carry_the_stack_of_the_free_else_of_the_allocation():
    # PyTorch's trace: both free entries carry the free's stack under context="all", the
    # allocation's under context="alloc" (what memory_viz shows for a free).
    for context in ("all", "alloc"):
        torch.cuda.memory._record_memory_history(context=context, stacks="python")
        try:
            x = torch.empty(MiB + 7, dtype=torch.uint8, device="cuda")
            address = x.data_ptr()
            del x
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        mine = [e for e in trace if e["addr"] == address and e["size"] == MiB + 7]
        by_action = {e["action"]: e for e in mine}
        assert set(by_action) >= {"alloc", "free_requested", "free_completed"}, (context, mine)
        for action in ("free_requested", "free_completed"):
            frames = by_action[action]["frames"]
            assert frames, (context, action)
            if context == "alloc":
                assert frames == by_action["alloc"]["frames"], (action, frames)
            else:  # the free's own stack: the `del` line, not the allocation's
                assert frames != by_action["alloc"]["frames"], (action, frames)
        assert by_action["free_completed"]["frames"] == by_action["free_requested"]["frames"]


def test_disabled_caching_allocator_uses_cuda_malloc_uncounted():
    stream = torch.cuda.current_stream().cuda_stream
    before = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
    torch.cuda.caching_allocator_enable(False)
    try:
        ptr = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
        during = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
        torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)
        t = torch.full((1000,), 7.0, device="cuda")
        assert t.sum().item() == 7000.0
        del t
    finally:
        torch.cuda.caching_allocator_enable(True)
    assert during == before
    ptr = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)
    assert torch.cuda.memory_stats()["requested_bytes.all.allocated"] == before + MiB


def test_profiler_sees_memory_events():
    with torch.profiler.profile(profile_memory=True) as prof:
        x = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        del x
    # The allocation is charged to the op that made it (aten::empty), the free outside any
    # op to a "[memory]" event.
    usage = [e.device_memory_usage for e in prof.events()]
    assert 2 * MiB in usage and -2 * MiB in usage, usage[:20]


def _raises(kind):
    """A context manager recording the message of the expected exception in a list."""
    class Raises:
        def __init__(self):
            self.message = []

        def __enter__(self):
            return self.message

        def __exit__(self, exc_type, exc, tb):
            assert exc_type is not None and issubclass(exc_type, kind), exc_type
            self.message.append(str(exc))
            return True

    return Raises()


if __name__ == "__main__":
    util.run_tests(globals())
