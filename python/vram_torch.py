"""vram's DevicePool as PyTorch's CUDA allocator (no build step in Python; needs
libvram_torch.so, built with cmake -DVRAM_BUILD_TORCH_PLUGIN=ON).

    import vram_torch
    vram_torch.enable()            # before anything initialises CUDA
    ... torch code as usual ...
    torch.cuda.max_memory_reserved(), torch.cuda.memory_stats(), torch.cuda.MemPool(), ...

With a library built against the installed Torch (CMAKE_PREFIX_PATH set to
torch.utils.cmake_prefix_path), enable() makes vram PyTorch's own CUDA allocator (mode()
== "native"): every torch.cuda memory call works over vram's pools (statistics, memory
history and snapshots, MemPool, CUDA graphs and graph trees, torch.multiprocessing).
A library built without Torch falls back to PyTorch's pluggable allocator interface
(mode() == "pluggable"), which lacks torch.cuda.memory_stats() and friends, snapshots,
MemPool and CUDA graph trees (torch.compile mode="reduce-overhead"); enable() warns.

Keeping PyTorch's caching allocator instead, with vram's pool as the source of one
MemPool's segments (a library of either build):

    pool = vram_torch.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(...)

The library is found at `path`, else $VRAM_TORCH_LIB, else libvram_torch.so in a build*/
folder of this repository (plugins/torch/). stats(), empty_cache() and reset_peak() need
only the library, not torch, and serve CuPy too (vram_cupy.py shares the same pools).
"""
import contextlib
import ctypes
import warnings
import glob
import operator
import os
import threading

__all__ = [
    "enable", "is_enabled", "mode", "allocator", "mem_pool", "use_mem_pool", "stats", "empty_cache",
    "reset_peak", "last_error", "library_path", "load_library", "configure", "offload",
    "region", "sleep", "wake", "pause", "resume", "wake_up", "tag_stats", "SleepError",
]

_STAT_FIELDS = (
    "allocated_bytes_current", "allocated_bytes_peak", "allocated_bytes_allocated",
    "allocated_bytes_freed", "requested_bytes_current", "requested_bytes_peak",
    "allocation_current", "allocation_peak", "allocation_allocated", "allocation_freed",
    "reserved_bytes_current", "reserved_bytes_peak", "cached_bytes", "num_device_alloc",
    "num_device_free", "num_alloc_retries", "num_ooms", "record_stream_calls",
    "held_back_blocks", "held_back_bytes", "graph_pool_bytes", "graph_pools",
    "unscoped_capture_calls", "graph_invalid_releases",
)


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _STAT_FIELDS]


_TAG_STAT_FIELDS = (
    "asleep", "discardable", "live_blocks", "live_bytes", "mapped_bytes", "backup_bytes",
    "backed_up_bytes", "copies", "sleeps", "wakes",
)


class _TagStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _TAG_STAT_FIELDS]


# vram_torch.h field -> torch.cuda.memory_stats() key (vram-only counters keep a
# "vram." prefix).
_KEYS = {
    "allocated_bytes_current": "allocated_bytes.all.current",
    "allocated_bytes_peak": "allocated_bytes.all.peak",
    "allocated_bytes_allocated": "allocated_bytes.all.allocated",
    "allocated_bytes_freed": "allocated_bytes.all.freed",
    "requested_bytes_current": "requested_bytes.all.current",
    "requested_bytes_peak": "requested_bytes.all.peak",
    "allocation_current": "allocation.all.current",
    "allocation_peak": "allocation.all.peak",
    "allocation_allocated": "allocation.all.allocated",
    "allocation_freed": "allocation.all.freed",
    "reserved_bytes_current": "reserved_bytes.all.current",
    "reserved_bytes_peak": "reserved_bytes.all.peak",
    "cached_bytes": "vram.cached_bytes",
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "record_stream_calls": "vram.record_stream_calls",
    "held_back_blocks": "vram.held_back_blocks",
    "held_back_bytes": "vram.held_back_bytes",
    "graph_pool_bytes": "vram.graph_pool_bytes",
    "graph_pools": "vram.graph_pools",
    "unscoped_capture_calls": "vram.unscoped_capture_calls",
    "graph_invalid_releases": "vram.graph_invalid_releases",
}

_lock = threading.Lock()
_enable_lock = threading.Lock()
_lib = None
_lib_path = None
_allocator = None
_enabled = False
_mode = None  # "native" or "pluggable" once enabled
record_stream_hook = False  # True once PyTorch forwards record_stream to vram


def library_path(path=None):
    """The libvram_torch.so that load_library() would use (raises if none is found)."""
    if path:
        return os.path.abspath(path)
    env = os.environ.get("VRAM_TORCH_LIB")
    if env:
        return os.path.abspath(env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(root, "build*", "plugins", "torch", "libvram_torch.so")),
                   key=os.path.getmtime, reverse=True)
    if not found:
        raise FileNotFoundError(
            "libvram_torch.so not found (no path given, VRAM_TORCH_LIB unset, none in a "
            "build*/plugins/torch/ folder of this repository). Fix: build it from the "
            "repository root: " + _BUILD_COMMAND + "; or pass its path or set VRAM_TORCH_LIB")
    return found[0]


def load_library(path=None):
    """Loads libvram_torch.so once (later calls return the same handle)."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path and os.path.abspath(path) != _lib_path:
                raise RuntimeError(f"vram_torch: {_lib_path} is already loaded; cannot switch "
                                   f"to {path} in the same process")
            return _lib
        resolved = library_path(path)
        lib = ctypes.CDLL(resolved)
        lib.vram_torch_alloc.restype = ctypes.c_void_p
        lib.vram_torch_alloc.argtypes = (ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        lib.vram_torch_free.restype = None
        lib.vram_torch_free.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p)
        lib.vram_torch_stats_size.restype = ctypes.c_size_t
        lib.vram_torch_stats_size.argtypes = ()
        lib.vram_torch_stats.restype = ctypes.c_int
        lib.vram_torch_stats.argtypes = (ctypes.c_int, ctypes.POINTER(_Stats), ctypes.c_size_t)
        lib.vram_torch_empty_cache.restype = ctypes.c_int
        lib.vram_torch_empty_cache.argtypes = (ctypes.c_int,)
        lib.vram_torch_reset_peak.restype = ctypes.c_int
        lib.vram_torch_reset_peak.argtypes = (ctypes.c_int,)
        lib.vram_torch_configure.restype = ctypes.c_int
        lib.vram_torch_configure.argtypes = (ctypes.c_size_t,)
        lib.vram_torch_set_oom_throws.restype = ctypes.c_int
        lib.vram_torch_set_oom_throws.argtypes = (ctypes.c_int,)
        lib.vram_torch_block_bytes.restype = ctypes.c_size_t
        lib.vram_torch_block_bytes.argtypes = (ctypes.c_int, ctypes.c_size_t)
        lib.vram_torch_ipc_export.restype = ctypes.c_int
        lib.vram_torch_ipc_export.argtypes = (ctypes.c_void_p, ctypes.c_char_p,
                                              ctypes.POINTER(ctypes.c_size_t))
        lib.vram_torch_ipc_open.restype = ctypes.c_void_p
        lib.vram_torch_ipc_open.argtypes = (ctypes.c_char_p, ctypes.c_int)
        lib.vram_torch_install_graph_hooks.restype = ctypes.c_int
        lib.vram_torch_install_graph_hooks.argtypes = ()
        if hasattr(lib, "vram_torch_install_native"):
            lib.vram_torch_install_native.restype = ctypes.c_int
            lib.vram_torch_install_native.argtypes = ()
            lib.vram_torch_torch_version.restype = ctypes.c_char_p
            lib.vram_torch_torch_version.argtypes = ()
        lib.vram_torch_region_enter.restype = ctypes.c_int
        lib.vram_torch_region_enter.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
        lib.vram_torch_region_exit.restype = ctypes.c_int
        lib.vram_torch_region_exit.argtypes = ()
        for name in ("vram_torch_sleep", "vram_torch_sleep_discard", "vram_torch_wake"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
        lib.vram_torch_tag_stats.restype = ctypes.c_int
        lib.vram_torch_tag_stats.argtypes = (ctypes.c_char_p, ctypes.c_int,
                                             ctypes.POINTER(_TagStats), ctypes.c_size_t)
        lib.vram_torch_last_error.restype = ctypes.c_size_t
        lib.vram_torch_last_error.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
        size = lib.vram_torch_stats_size()
        if size < ctypes.sizeof(_Stats):
            raise RuntimeError(f"vram_torch: {resolved} has a {size}-byte stats struct, this "
                               f"module expects {ctypes.sizeof(_Stats)}: rebuild the library")
        _lib, _lib_path = lib, resolved
        return lib


_BUILD_COMMAND = (
    "cmake -S . -B build-torch -DVRAM_BUILD_TORCH_PLUGIN=ON -DVRAM_BUILD_TESTS=OFF "
    "-DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)') "
    "&& cmake --build build-torch --target vram_torch")


def _torch(what):
    """torch, or an ImportError naming what needed it and how to get it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"vram_torch.{what} needs PyTorch, which this Python cannot import ({e}). Fix: "
            "install PyTorch (pip install torch), then build the plug-in against it: "
            + _BUILD_COMMAND + " (README, PyTorch). Without PyTorch, stats(), "
            "empty_cache() and reset_peak() serve CuPy (vram_cupy.py).") from e
    return torch


def _symbol_address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


_SIZE_MAX = 2**64 - 1  # size_t's range, which ctypes would otherwise wrap into
_INT_MAX = 2**31 - 1  # int's


def _size_arg(value, what):
    """`value` as a size_t argument; ValueError outside 0 .. 2**64 - 1 (ctypes would wrap
    it onto a valid size)."""
    value = int(value)
    if not 0 <= value <= _SIZE_MAX:
        raise ValueError(f"vram_torch: {what} must be between 0 and 2**64 - 1, not {value}")
    return value


def configure(max_cached_bytes=0, path=None):
    """Options of pools not yet created (call before the first allocation). Returns False
    when a pool already exists (it keeps its options)."""
    max_cached_bytes = _size_arg(max_cached_bytes, "max_cached_bytes")
    return load_library(path).vram_torch_configure(max_cached_bytes) == 0


def allocator(path=None):
    """The torch.cuda.memory.CUDAPluggableAllocator over libvram_torch.so (one per process),
    with empty_cache and record_stream forwarded to vram."""
    global _allocator, record_stream_hook
    torch = _torch("allocator()")

    lib = load_library(path)
    with _lock:
        if _allocator is None:
            alloc = torch.cuda.memory.CUDAPluggableAllocator(
                _lib_path, "vram_torch_alloc", "vram_torch_free")
            raw = alloc.allocator()
            if hasattr(raw, "set_reset_fn"):
                raw.set_reset_fn(_symbol_address(lib, "vram_torch_empty_cache_all"))
            if hasattr(raw, "set_record_stream_fn"):
                raw.set_record_stream_fn(_symbol_address(lib, "vram_torch_record_stream"))
                record_stream_hook = True
            _allocator = alloc
        return _allocator


_PLUGGABLE_LACKS = (
    "torch.cuda.memory_stats()/memory_allocated()/max_memory_reserved() and the other "
    "statistics, torch.cuda.memory._record_memory_history() and snapshots, "
    "torch.cuda.MemPool, set_per_process_memory_fraction and torch.compile "
    "mode='reduce-overhead' (CUDA graph trees)")


def enable(path=None):
    """Makes vram PyTorch's CUDA allocator for this process. Must run before CUDA is
    initialised (before the first tensor on a GPU, torch.cuda.init(), ...). Returns the
    mode: "native" (vram is PyTorch's own allocator) or "pluggable" (a library built
    without Torch)."""
    torch = _torch("enable()")
    with _enable_lock:  # one installation at a time: racing callers would both install
        return _enable(torch, path)


def _enable(torch, path):
    global _enabled, _mode
    if _enabled:
        return _mode
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "vram_torch.enable() must run before CUDA is initialised in this process (a CUDA "
            "tensor, torch.cuda.init() or a memory query already ran). Fix: call "
            "vram_torch.enable() right after `import torch`, or use the MemPool form: "
            "`with torch.cuda.use_mem_pool(vram_torch.mem_pool()): ...`")
    lib = load_library(path)
    installed = 0
    if hasattr(lib, "vram_torch_install_native"):
        built = lib.vram_torch_torch_version().decode()
        running = torch.__version__.split("+")[0]
        if built and built != running:
            raise RuntimeError(
                f"vram_torch.enable(): {library_path(path)} was built against Torch {built}, "
                f"this process runs Torch {running}; PyTorch's allocator interface differs "
                "between versions. Fix: rebuild the library against the installed Torch "
                "(README, PyTorch).")
        installed = lib.vram_torch_install_native()
    if installed == 1:
        global record_stream_hook
        record_stream_hook = True  # recordStream is part of the native interface
        _enabled, _mode = True, "native"
        return _mode
    if installed < 0:
        raise RuntimeError("vram_torch.enable(): " + last_error())
    warnings.warn(
        "vram_torch: " + library_path(path) + " has no native allocator (built without Torch, "
        "or before it existed), so vram is PyTorch's pluggable allocator, which lacks "
        + _PLUGGABLE_LACKS + ". Fix: rebuild it with "
        "CMAKE_PREFIX_PATH=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)') "
        "(README, PyTorch).")
    alloc = allocator(path)
    # PyTorch wraps a null pointer from a pluggable allocator into a tensor: in this mode
    # the library raises torch.OutOfMemoryError instead (when built with Torch found).
    lib.vram_torch_set_oom_throws(1)
    torch.cuda.memory.change_current_allocator(alloc)
    _guard_graphs(torch, lib.vram_torch_install_graph_hooks() == 1)
    _share_cuda_tensors(torch)
    _enabled, _mode = True, "pluggable"
    return _mode


def mode():
    """"native", "pluggable", or None before enable()."""
    return _mode


_IPC_HANDLE_BYTES = 64


class _Mapped:
    """`nbytes` of device memory at `pointer` for torch.as_tensor (__cuda_array_interface__);
    the mapping stays for the life of the process (vram_torch_ipc_open's cache)."""

    def __init__(self, pointer, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 3}


def _rebuild_cuda_tensor(handle, offset, nbytes, dtype, size, stride, storage_offset, device,
                         requires_grad):
    """The receiving side of torch.multiprocessing: maps the sender's segment (once per
    process) and makes a tensor over the same memory."""
    import torch

    if not isinstance(handle, (bytes, bytearray)) or len(handle) != _IPC_HANDLE_BYTES:
        raise ValueError(f"vram_torch: a CUDA IPC handle is {_IPC_HANDLE_BYTES} bytes")
    base = load_library().vram_torch_ipc_open(bytes(handle), _device_index(device))
    if not base:
        raise RuntimeError("vram_torch: cannot import a shared CUDA tensor: " + last_error())
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Mapped(base + offset, nbytes), device=f"cuda:{device}")
    tensor = raw.view(dtype).as_strided(size, stride, storage_offset)
    tensor.requires_grad_(requires_grad)
    return tensor


def _share_cuda_tensors(torch):
    """torch.multiprocessing shares CUDA tensors through the allocator's IPC calls, which
    PyTorch's pluggable allocator lacks: vram's reducers export the block's cudaMalloc
    segment instead (blocks over CUDA virtual memory are refused with the fix)."""
    import torch.multiprocessing  # noqa: F401  (registers PyTorch's reducers first)
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions

    original = reductions.reduce_tensor

    def reduce_tensor(tensor):
        if not tensor.is_cuda:
            return original(tensor)
        if tensor.requires_grad and not tensor.is_leaf:
            raise RuntimeError("vram_torch: cannot share a CUDA tensor that requires grad and "
                               "is not a leaf; detach() it first")
        storage = tensor.untyped_storage()
        handle = ctypes.create_string_buffer(_IPC_HANDLE_BYTES)
        offset = ctypes.c_size_t(0)
        if load_library().vram_torch_ipc_export(storage.data_ptr(), handle,
                                                ctypes.byref(offset)) != 0:
            raise RuntimeError("vram_torch: cannot share this CUDA tensor between processes: "
                               + last_error())
        return (_rebuild_cuda_tensor,
                (handle.raw, offset.value, storage.nbytes(), tensor.dtype, tuple(tensor.size()),
                 tuple(tensor.stride()), tensor.storage_offset(), tensor.device.index,
                 tensor.requires_grad))

    for cls in [torch.Tensor, torch.nn.parameter.Parameter] + list(torch._tensor_classes):
        ForkingPickler.register(cls, reduce_tensor)


_REDUCE_OVERHEAD_MESSAGE = (
    "vram_torch: torch.compile(mode='reduce-overhead') records CUDA graph trees, which need "
    "allocator checkpoints (checkPoolLiveAllocations, getCheckpointState) that PyTorch's "
    "pluggable allocator interface cannot provide, and this libvram_torch.so was built "
    "without Torch. Fix: rebuild it against the installed Torch (vram then is PyTorch's own "
    "allocator and runs reduce-overhead), or compile with mode='max-autotune-no-cudagraphs' "
    "(or the default mode).")


def _guard_graphs(torch, hooks_set):
    """With vram as the allocator: CUDA graph trees (torch.compile reduce-overhead) fail at
    their first allocator checkpoint with vram's message; without the capture hooks (a
    build without Torch), torch.cuda.graph fails at capture_begin instead of letting a
    graph's memory be handed to other tensors."""
    def refuse(*args, **kwargs):
        raise RuntimeError(_REDUCE_OVERHEAD_MESSAGE)

    for name in ("_cuda_checkPoolLiveAllocations", "_cuda_getCheckpointState",
                 "_cuda_setCheckpointPoolState"):
        if hasattr(torch._C, name):
            setattr(torch._C, name, refuse)
    if hooks_set:
        return
    reason = last_error()

    def capture_begin(self, *args, **kwargs):
        raise RuntimeError(
            "vram_torch: CUDA graph capture is refused: " + reason + ". Without the capture "
            "hooks a graph's memory would be handed to other tensors.")

    torch.cuda.graphs.CUDAGraph.capture_begin = capture_begin
    warnings.warn("vram_torch: " + reason + "; CUDA graph capture is refused in this process.")


def block_bytes(nbytes, device=0, path=None):
    """The bytes vram reserves for a request of `nbytes` on `device` (its rounding); 0 until
    the device's pool exists (its first allocation makes it, with the options then set)."""
    return load_library(path).vram_torch_block_bytes(_device_index(device),
                                                     _size_arg(nbytes, "nbytes"))


def is_enabled():
    return _enabled


def mem_pool(path=None, **kwargs):
    """A torch.cuda.MemPool over vram: with enable() in native mode, a private pool of
    vram's allocator; otherwise one whose segments come from vram's pool, PyTorch's caching
    allocator (and torch.cuda.memory_stats) staying in charge of the blocks inside it."""
    torch = _torch("mem_pool()")

    if _mode == "native":
        return torch.cuda.MemPool(**kwargs)
    return torch.cuda.MemPool(allocator(path).allocator(), **kwargs)


@contextlib.contextmanager
def use_mem_pool(pool=None, device=None):
    """`with vram_torch.use_mem_pool(): ...` routes this thread's allocations to `pool`
    (a new mem_pool() if None); yields the pool."""
    torch = _torch("use_mem_pool()")

    pool = pool if pool is not None else mem_pool()
    with torch.cuda.use_mem_pool(pool, device=device):
        yield pool


def _device_index(device):
    """The ordinal of `device` (an int, a torch.device, a CuPy device, "cuda:N"; None: the
    current one); ValueError when it is negative or beyond a C int (ctypes would wrap it
    onto a valid ordinal)."""
    index = _device_ordinal(device)
    if not 0 <= index <= _INT_MAX:
        raise ValueError(f"vram_torch: bad device {device!r}")
    return index


def _device_ordinal(device):
    if device is None:
        try:
            import torch

            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except ImportError:
            pass
        return 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device / cupy.cuda.Device (.id)
    if index is None:
        index = getattr(device, "id", None)
    if index is None and isinstance(device, str):
        index = int(device.split(":")[1]) if ":" in device else 0
    return int(index or 0)


def stats(device=None, path=None):
    """vram's counters of `device` as a dict named like torch.cuda.memory_stats(); every
    value is 0 until the device's pool exists (its first allocation makes it)."""
    lib = load_library(path)
    raw = _Stats()
    if lib.vram_torch_stats(_device_index(device), ctypes.byref(raw), ctypes.sizeof(raw)) < 0:
        raise ValueError(f"vram_torch.stats: bad device {device!r}")
    return {_KEYS[name]: int(getattr(raw, name)) for name in _STAT_FIELDS}


def empty_cache(device=-1, path=None):
    """Waits for blocks held back for recorded streams, then frees every cached block to
    cudaFree (device -1: all devices). Live tensors are untouched."""
    device = -1 if device == -1 else _device_index(device)
    if load_library(path).vram_torch_empty_cache(device) != 0:
        raise ValueError(f"vram_torch.empty_cache: bad device {device}")


def reset_peak(device=-1, path=None):
    """Restarts the peak counters from the current values (device -1: all devices)."""
    device = -1 if device == -1 else _device_index(device)
    if load_library(path).vram_torch_reset_peak(device) != 0:
        raise ValueError(f"vram_torch.reset_peak: bad device {device}")


def last_error(path=None):
    """The latest out-of-memory or error explanation of the library ('' if none)."""
    lib = load_library(path)
    size = lib.vram_torch_last_error(None, 0)
    if size == 0:
        return ""
    buffer = ctypes.create_string_buffer(size + 1)
    lib.vram_torch_last_error(buffer, size + 1)
    return buffer.value.decode("utf-8", "replace")


def offload(module, budget, device=0, **options):
    """Runs `module` larger than the GPU: its weights stay in host memory and stream through
    vram's WeightPager within `budget` bytes of `device` (python/vram_offload.py)."""
    import vram_offload

    return vram_offload.offload(module, budget, device, **options)


# ---- Sleep and wake (docs/sleep-wake.md) -------------------------------------------------
# Tensors allocated inside `with region(tag):` live in the tag's own virtual memory; the tag
# can sleep (contents to pinned host memory, GPU memory released, addresses kept) and wake
# (mapped again at the same addresses, contents back), so tensors and CUDA graphs captured
# over them stay valid. The names mirror torch_memory_saver (region / pause / resume) and
# vLLM (sleep(level) / wake_up(tags)).

class SleepError(RuntimeError):
    """A sleep, wake or region call that vram refused or that failed; nothing changed."""


_tag_names = []  # every tag a region made, in order (sleep()/wake() without tags: all)
_tag_lock = threading.Lock()


def _encode_tag(tag):
    if not isinstance(tag, str) or not tag or "\0" in tag:
        raise ValueError(f"vram_torch: a tag is a non-empty str without NUL, not {tag!r}")
    return tag.encode("utf-8")


def _tags_of(tags):
    if tags is None:
        with _tag_lock:
            return list(_tag_names)
    if isinstance(tags, str):
        return [tags]
    try:
        return list(tags)
    except TypeError:
        raise ValueError(f"vram_torch: tags are a str, a list of str or None, not {tags!r}")


def _stream_handle(stream):
    if stream is None:
        return None
    handle = getattr(stream, "cuda_stream", stream)
    return ctypes.c_void_p(int(handle))


@contextlib.contextmanager
def region(tag="default", discardable=None, device=None, enable_cpu_backup=None, path=None):
    """`with vram_torch.region("weights"):` tags this thread's CUDA allocations on `device`
    (default: the current one) until the block ends. discardable=True (a KV cache): sleep
    copies nothing and wake gives the memory back uninitialised. enable_cpu_backup is
    torch_memory_saver's spelling of the opposite (discardable = not enable_cpu_backup);
    without either the contents are kept. Needs vram as the allocator (enable())."""
    if discardable is None:
        discardable = enable_cpu_backup is not None and not enable_cpu_backup
    if not _enabled:
        raise SleepError("vram_torch.region: vram is not PyTorch's allocator; call "
                         "vram_torch.enable() before CUDA starts")
    lib = load_library(path)
    name = _encode_tag(tag)
    if lib.vram_torch_region_enter(name, 1 if discardable else 0, _device_index(device)) != 0:
        raise SleepError(f"vram_torch.region({tag!r}): {last_error(path)}")
    with _tag_lock:
        if tag not in _tag_names:
            _tag_names.append(tag)
    try:
        yield
    finally:
        lib.vram_torch_region_exit()


def _each(call, tags, stream, device, path):
    lib = load_library(path)
    fn = getattr(lib, "vram_torch_" + call)
    names = _tags_of(tags)
    if not names:
        raise SleepError(f"vram_torch.{call}: no tags (no region() made one yet)")
    encoded = [_encode_tag(t) for t in names]
    device = -1 if device is None else _device_index(device)
    done = []
    for tag, name in zip(names, encoded):
        if fn(name, device, _stream_handle(stream)) != 0:
            raise SleepError(f"vram_torch.{call}({tag!r}): {last_error(path)}"
                             + (f" (done before it: {done})" if done else ""))
        done.append(tag)


def sleep(tags=None, level=1, stream=None, device=None, path=None):
    """Puts `tags` (a str, a list, or None: every tag a region made) to sleep on `device`
    (None: every device that has them): the contents of non-discardable tags go to pinned
    host memory (pinned at the first sleep and reused), then the GPU memory is released;
    addresses stay reserved. stream=None synchronizes the device first; with a stream
    (torch.cuda.Stream or a handle) the copies follow the work queued on it.
    level: vLLM's sleep level. 1 (the default): each tag keeps what its kind keeps (the
    contents of discardable tags are dropped, the others' copied to host memory). 2: every
    tag's contents are dropped, nothing is copied; after wake the memory is uninitialised
    and the caller reloads the weights (the tags' pinned backups, if any, are kept)."""
    try:
        whole = None if isinstance(level, bool) else operator.index(level)  # numpy ints too
    except TypeError:
        whole = None
    if whole not in (1, 2):
        raise ValueError(f"vram_torch.sleep: level is 1 (keep the contents of tags that keep "
                         f"them) or 2 (drop every tag's contents), not {level!r}")
    level = whole
    _each("sleep" if level == 1 else "sleep_discard", tags, stream, device, path)


def wake(tags=None, stream=None, device=None, path=None):
    """Maps the memory of sleeping `tags` again at the same addresses and copies the
    contents back (discardable tags: uninitialised). Returns after the copies completed."""
    _each("wake", tags, stream, device, path)


def wake_up(tags=None, stream=None, device=None, path=None):
    """vLLM's spelling of wake(tags)."""
    wake(tags, stream, device, path)


def pause(tag=None, path=None):
    """torch_memory_saver's spelling of sleep(tag) (None: every tag)."""
    sleep(tag, path=path)


def resume(tag=None, path=None):
    """torch_memory_saver's spelling of wake(tag) (None: every tag)."""
    wake(tag, path=path)


def tag_stats(tag, device=None, path=None):
    """The counters of tag `tag` on `device` as a dict (asleep, live_bytes, mapped_bytes,
    backup_bytes, ...); None when that device has no such tag."""
    lib = load_library(path)
    raw = _TagStats()
    status = lib.vram_torch_tag_stats(_encode_tag(tag), _device_index(device), ctypes.byref(raw),
                                      ctypes.sizeof(raw))
    if status == 1:
        return None
    if status != 0:
        raise SleepError(f"vram_torch.tag_stats({tag!r}): {last_error(path)}")
    return {name: int(getattr(raw, name)) for name in _TAG_STAT_FIELDS}
