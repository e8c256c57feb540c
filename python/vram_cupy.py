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
"""
import vram_torch

__all__ = ["enable", "disable", "malloc", "stats", "empty_cache", "reset_peak", "last_error"]

stats = vram_torch.stats
empty_cache = vram_torch.empty_cache
reset_peak = vram_torch.reset_peak
last_error = vram_torch.last_error


class _Block:
    """Owner of one vram block; frees it when CuPy releases the memory."""

    __slots__ = ("ptr", "size", "device", "stream", "free", "__weakref__")

    def __init__(self, ptr, size, device, stream, free):
        self.ptr, self.size, self.device, self.stream, self.free = ptr, size, device, stream, free

    def __del__(self):
        free, self.free = self.free, None
        if free is not None and self.ptr:
            try:
                free(self.ptr, self.size, self.device, self.stream)
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
    stream = cupy.cuda.get_current_stream().ptr
    ptr = lib.vram_torch_alloc(size, device, stream)
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
