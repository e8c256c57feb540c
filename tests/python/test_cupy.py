"""vram's pools as CuPy's allocator (vram_cupy.enable -> cupy.cuda.set_allocator)."""
import vram_test_util as util

try:
    import cupy
except ImportError as e:
    util.skip_module(f"cupy is not installed ({e})")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        util.skip_module("no CUDA device visible to cupy")
except cupy.cuda.runtime.CUDARuntimeError as e:
    util.skip_module(f"no CUDA device visible to cupy ({e})")

import vram_cupy  # noqa: E402
import vram_torch  # noqa: E402

vram_cupy.enable()
MiB = util.MiB


def test_arrays_come_from_vram_and_compute_correctly():
    before = vram_torch.stats()
    a = cupy.arange(4 * MiB, dtype=cupy.float32)  # 16 MiB
    b = a * 2 + 1
    during = vram_torch.stats()
    assert during["allocation.all.allocated"] - before["allocation.all.allocated"] >= 2
    assert during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] >= \
        2 * vram_torch.block_bytes(16 * MiB)
    expected = cupy.asnumpy(cupy.arange(4 * MiB, dtype=cupy.float32)) * 2 + 1
    assert (cupy.asnumpy(b) == expected).all()
    del a, b
    after = vram_torch.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"], (
        before, after)


def test_non_default_stream_and_reuse():
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(16):
            x = cupy.full(MiB, i, dtype=cupy.int32)
            assert int(x.sum()) == i * MiB
            del x
    stream.synchronize()
    s = vram_torch.stats()
    assert s["allocation.all.current"] >= 0
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]


def test_empty_cache_and_oom():
    big = cupy.empty(256 * MiB, dtype=cupy.uint8)
    del big
    cupy.cuda.Device().synchronize()
    before = vram_torch.stats()["reserved_bytes.all.current"]
    vram_cupy.empty_cache()
    assert vram_torch.stats()["reserved_bytes.all.current"] <= before - 256 * MiB
    total = cupy.cuda.Device().mem_info[1]
    try:
        cupy.empty(2 * total, dtype=cupy.uint8)
    except cupy.cuda.memory.OutOfMemoryError:
        pass
    else:
        raise AssertionError("allocating twice the device did not raise OutOfMemoryError")
    assert vram_torch.stats()["num_ooms"] >= 1
    y = cupy.ones(MiB, dtype=cupy.float32)  # still works
    assert float(y.sum()) == float(MiB)


def test_streams_dropped_after_their_frees_stay_valid_for_the_pool():
    # Blocks freed on a stream wait in the pool tagged with it, and the pool may record a
    # marker on that stream when another stream's request would make it grow: CuPy destroys a
    # stream with its last reference, so vram_cupy keeps freed-on streams until a trim (at
    # most _MAX_KEPT_STREAMS). Before, dropping the stream could crash the next growth.
    for round_ in range(3 * vram_cupy._MAX_KEPT_STREAMS):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for i in range(4):
                x = cupy.full(MiB, round_ + i, dtype=cupy.int32)  # 4 MiB: the large tier
                del x
        del stream
        assert len(vram_cupy._kept_streams) <= vram_cupy._MAX_KEPT_STREAMS
    # Growth on the default stream: every other stream with free blocks may be fenced.
    big = cupy.zeros(512 * MiB, dtype=cupy.uint8)
    big += 3
    assert int(big[::MiB].sum()) == 3 * 512
    del big
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    util.run_tests(globals())
