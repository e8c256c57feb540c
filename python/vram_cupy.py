"""vram's DevicePool as CuPy's allocator: the same per-device pools as vram_torch (one
libvram_torch.so per process), so PyTorch and CuPy in one process share them.

    import vram_cupy
    vram_cupy.enable()                  # cupy.cuda.set_allocator(vram_cupy.malloc)
    x = cupy.arange(1 << 20)
    vram_cupy.stats()                   # == vram_torch.stats()

Each block is allocated for CuPy's current stream and freed, when CuPy drops its last
reference, with that same stream (stream-ordered: reusable at once on it, by another stream
only after the work queued on it at the free). As with CuPy's own pool, an array used on
another stream needs the user's synchronisation before its memory is dropped.

Stream lifetime: the pool records a marker on a stream whose freed blocks another stream
needs, so a stream must stay valid while blocks freed on it wait in the pool (DevicePool's
rule), and CuPy destroys a cupy.cuda.Stream as soon as its last reference goes. So a block
keeps its stream object alive while it lives, and a stream a block was freed on is kept
here until the pool is trimmed (which waits for the device and forgets every stream's
frees): at most _MAX_KEPT_STREAMS streams, then empty_cache() runs and they are let go.
The default streams (legacy, per-thread) never go away and are not kept. (Before this, a
CuPy program that freed on a stream and dropped it could crash in the pool's next growth:
one segmentation fault in tests/python/test_cupy.py on the H200 at 396c1c2, 2026-11-30.)
"""
import threading

import vram_torch

__all__ = ["enable", "disable", "malloc", "stats", "empty_cache", "reset_peak", "last_error"]

stats = vram_torch.stats
empty_cache = vram_torch.empty_cache
reset_peak = vram_torch.reset_peak
last_error = vram_torch.last_error


_MAX_KEPT_STREAMS = 64
_DEFAULT_STREAMS = (0, 1, 2)  # 0 / cudaStreamLegacy: legacy default; 2: per-thread default
_streams_lock = threading.RLock()  # re-entered if a collection frees a block inside
_kept_streams = {}  # handle -> cupy.cuda.Stream: blocks freed on it may wait in the pool


def _free_on_stream(free, ptr, size, device, stream):
    """Frees a block stream-ordered on `stream` (a cupy.cuda.Stream) and keeps the stream
    valid while the pool may need it (see the module comment)."""
    handle = stream.ptr
    if handle in _DEFAULT_STREAMS:
        free(ptr, size, device, handle)
        return
    # Under the lock: no free on a kept stream races the trim that lets the streams go.
    with _streams_lock:
        if handle not in _kept_streams and len(_kept_streams) >= _MAX_KEPT_STREAMS:
            vram_torch.load_library().vram_torch_empty_cache(-1)
            _kept_streams.clear()
        _kept_streams[handle] = stream
        free(ptr, size, device, handle)


class _Block:
    """Owner of one vram block; frees it when CuPy releases the memory. `stream` is the
    cupy.cuda.Stream it was allocated for (kept alive with the block)."""

    __slots__ = ("ptr", "size", "device", "stream", "free", "__weakref__")

    def __init__(self, ptr, size, device, stream, free):
        self.ptr, self.size, self.device, self.stream, self.free = ptr, size, device, stream, free

    def __del__(self):
        free, self.free = self.free, None
        if free is not None and self.ptr:
            try:
                _free_on_stream(free, self.ptr, self.size, self.device, self.stream)
            except Exception:  # interpreter shutdown: the process frees everything anyway
                pass


def malloc(size):
    """A cupy.cuda.MemoryPointer to `size` bytes of vram's pool of the current device."""
    import cupy

    lib = vram_torch.load_library()
    device = cupy.cuda.runtime.getDevice()
    if size == 0:
        mem = cupy.cuda.memory.UnownedMemory(0, 0, None, device)
        return cupy.cuda.memory.MemoryPointer(mem, 0)
    stream = cupy.cuda.get_current_stream()
    ptr = lib.vram_torch_alloc(size, device, stream.ptr)
    if not ptr:
        raise cupy.cuda.memory.OutOfMemoryError(size, vram_torch.stats(device)[
            "allocated_bytes.all.current"])
    owner = _Block(ptr, size, device, stream, lib.vram_torch_free)
    mem = cupy.cuda.memory.UnownedMemory(ptr, size, owner, device)
    return cupy.cuda.memory.MemoryPointer(mem, 0)


def enable(path=None):
    """Makes vram CuPy's allocator (cupy.cuda.set_allocator) in this process."""
    import cupy

    vram_torch.load_library(path)
    cupy.cuda.set_allocator(malloc)


def disable():
    """Back to CuPy's default memory pool."""
    import cupy

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
