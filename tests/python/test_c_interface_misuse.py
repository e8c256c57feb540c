"""The C route of libvram_torch.so (vram_torch_alloc / vram_torch_free, as PyTorch's
pluggable allocator and CuPy call it) under bad arguments, and the Python wrappers' checks
of what ctypes would otherwise wrap. Called through ctypes, without enable(): the pools are
the library's own, made by the first vram_torch_alloc."""
import ctypes

import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

lib = vram_torch.load_library()
KiB = 1024


def alloc(size, device=0):
    ptr = lib.vram_torch_alloc(size, device, None)
    assert ptr, vram_torch.last_error()
    return ptr


def free(ptr, size, device=0):
    lib.vram_torch_free(ptr, size, device, None)


def current():
    s = vram_torch.stats(0)
    return s["allocation.all.current"], s["allocated_bytes.all.current"]


def test_a_second_free_is_refused_and_never_hands_one_block_to_two_owners():
    torch.cuda.synchronize()
    before = current()
    p = alloc(KiB)
    free(p, KiB)
    assert current() == before
    free(p, KiB)  # the second free: refused, counted nowhere
    assert "freed twice" in vram_torch.last_error(), vram_torch.last_error()
    assert current() == before
    a = alloc(KiB)
    b = alloc(KiB)
    assert a != b
    free(a, KiB)
    free(b, KiB)
    assert current() == before


def test_a_foreign_pointer_never_reaches_the_pool():
    host = ctypes.create_string_buffer(64 * KiB)
    address = ctypes.addressof(host)
    aligned = (address + 255) // 256 * 256  # as a block would be aligned
    before = current()
    free(aligned, KiB)
    assert "ignored" in vram_torch.last_error()
    assert current() == before
    handed = [alloc(KiB) for _ in range(64)]
    assert aligned not in handed
    for p in handed:
        free(p, KiB)
    assert current() == before


def test_a_free_naming_another_device_changes_nothing():
    before = current()
    p = alloc(KiB)
    free(p, KiB, device=1)  # no block of device 1 (whether or not it exists)
    free(p, KiB, device=-1)
    free(p, KiB, device=1 << 30)
    assert current()[0] == before[0] + 1  # still live on device 0
    free(p, KiB)
    assert current() == before


def test_a_free_with_another_size_frees_the_block_as_allocated():
    before = current()
    p = alloc(KiB)
    free(p, 1 << 40)  # another size (1 TiB): the recorded size is what goes back
    assert "allocated with 1024" in vram_torch.last_error(), vram_torch.last_error()
    assert current() == before
    free(p, KiB)  # and it is freed once only
    assert current() == before


def test_record_stream_ignores_pointers_that_are_no_live_block():
    lib.vram_torch_record_stream.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    side = torch.cuda.Stream()
    p = alloc(4 * KiB)
    calls = vram_torch.stats(0)["vram.record_stream_calls"]
    lib.vram_torch_record_stream(p + 512, ctypes.c_void_p(side.cuda_stream))  # inside it
    assert vram_torch.stats(0)["vram.record_stream_calls"] == calls
    free(p, 4 * KiB)
    lib.vram_torch_record_stream(p, ctypes.c_void_p(side.cuda_stream))  # freed already
    assert vram_torch.stats(0)["vram.record_stream_calls"] == calls
    # Nothing is held back for it: the next frees on the device take the warm path.
    assert vram_torch.stats(0)["vram.held_back_blocks"] == 0


def test_stats_of_a_bad_device_is_a_bad_argument():
    raw = vram_torch._Stats()
    for device in (-1, 64, -(1 << 31)):
        assert lib.vram_torch_stats(device, ctypes.byref(raw), ctypes.sizeof(raw)) == -1, device
    assert lib.vram_torch_stats(0, ctypes.byref(raw), ctypes.sizeof(raw)) == 0


def test_the_wrappers_refuse_what_ctypes_would_wrap():
    bad = [
        lambda: vram_torch.stats(device=-3),
        lambda: vram_torch.stats(device=1 << 32),
        lambda: vram_torch.empty_cache(1 << 32),
        lambda: vram_torch.block_bytes((1 << 64) + KiB),
        lambda: vram_torch.block_bytes(-1),
        lambda: vram_torch.configure(-1),
        lambda: vram_torch.configure(1 << 64),
        lambda: vram_torch._encode_tag("a\0b"),
        lambda: vram_torch._rebuild_cuda_tensor(b"short", 0, 4, torch.uint8, (4,), (1,), 0, 0,
                                                False),
    ]
    for i, call in enumerate(bad):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"case {i} was accepted")
    assert vram_torch.block_bytes(KiB, device=0) >= KiB  # good arguments still work


if __name__ == "__main__":
    util.run_tests(globals())
