"""vram_torch.offload: a PyTorch module larger than the GPU, at the speed of the link.

    import vram_torch
    handle = vram_torch.offload(model, budget="2GiB")   # model on the CPU (or the GPU)
    print(handle.report())                              # what it decided
    out = model.generate(input_ids, max_new_tokens=64)  # inputs are moved to the device
    print(handle.stats())                               # page-ins, stalls, bytes copied

The parameters stay in host memory (one packed buffer, pinned by vram's WeightPager in
bounded registrations, or staged through pinned buffers: host="automatic" | "pinned" |
"pageable"). The work is C++ (libvram_torch.so, plugins/torch/offload.cpp over
vram::WeightPager): this module only hooks the modules and makes tensor views over the
device pointers the pager returns.

Pieces and units
  A unit is a part of the model (by default the items of its ModuleLists, e.g. a
  transformer's decoder layers, and the parameter-holding modules outside them; `units`
  overrides). A piece is what the pager moves: with granularity="leaf" (default) the
  parameters of one parameter-holding module (a Linear), with "unit" a whole unit. Small
  pieces (< small_bytes) and every buffer stay on the device as ordinary tensors (counted in
  the budget). The pager keeps resident the pieces worth most per byte and streams the rest
  through a ring of prefetch_depth + 1 slots of the largest streamed piece: smaller pieces
  mean a smaller ring and more budget for resident weights.

Ordering
  A module's forward pre-hook acquires its pieces (the device pointer is ordered before
  the work queued next on the current stream: no host synchronisation) and points the
  module's parameters at views of it; the forward hook releases them (evictable once the
  work queued so far on that stream ran) and points the parameters back at the host copy.
  Outside a forward, model.parameters() are the host copies (exact values, on the CPU);
  tensors given to the top-level forward are moved to the device first.

Schedule
  The pager prefetches by the schedule: the order of piece uses of one forward. It is the
  registration order until the first forward (or `schedule=` names pieces), learned from
  the first forward (the pager is rebuilt if it differed), and learned again when two
  forwards in a row follow the same new order (relearn=True). A forward off the schedule is
  never wrong: each piece is paged in on demand when its prefetch was not issued; such
  acquires are counted (stats()["out_of_order"]).

Inference only: a module input that requires grad is refused (the weights' device memory
is reused as soon as the module's forward returns). Parameters shared between modules
(tied embeddings) are stored once. A module already on the GPU is copied to host memory
first (its device tensors are dropped). Do not call .to()/.cuda() on an offloaded module;
remove() puts the host copies back as ordinary CPU parameters.
"""
import ctypes
import re
import sys

import vram_torch

__all__ = ["offload", "Offload", "parse_bytes"]

_HOST_MODES = {"automatic": 0, "pinned": 1, "pageable": 2}
_TENSOR_ALIGN = 256  # a tensor's place inside its piece
_PIECE_ALIGN = 4096  # a piece's place in the host buffer (page-aligned pinning)


class _Options(ctypes.Structure):
    _fields_ = [("budget_bytes", ctypes.c_size_t), ("prefetch_depth", ctypes.c_size_t),
                ("device", ctypes.c_int), ("host", ctypes.c_int), ("host_double", ctypes.c_int),
                ("fill_threads", ctypes.c_uint), ("staging_chunk_bytes", ctypes.c_size_t),
                ("staging_buffers", ctypes.c_size_t), ("stall_sample_period", ctypes.c_uint)]


_PLAN_FIELDS = ("arena_bytes", "resident_bytes", "slot_bytes", "slot_count", "prefetch_depth",
                "streamed_bytes_per_step", "resident_pieces", "pinned", "pinned_bytes",
                "register_calls", "already_pinned_bytes")


class _Plan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in _PLAN_FIELDS] + [
        ("pin_seconds", ctypes.c_double), ("upload_seconds", ctypes.c_double)]


_STAT_FIELDS = ("acquires", "hits", "page_ins", "prefetches", "bytes_paged_in",
                "timed_page_ins", "timed_bytes", "stall_samples", "stalled", "staging_pin_calls")


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in _STAT_FIELDS] + [
        (n, ctypes.c_double) for n in ("timed_copy_ms", "effective_gbps", "stall_ms_sampled",
                                       "host_wait_ms")]


def _bind(lib):
    if getattr(lib, "_vram_offload_bound", False):
        return lib
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "vram_torch_pager_min_budget": (sz, (sz, ctypes.POINTER(sz), sz)),
        "vram_torch_pager_create": (vp, (sz, ctypes.POINTER(vp), ctypes.POINTER(sz),
                                         ctypes.POINTER(sz), sz, ctypes.POINTER(_Options),
                                         ctypes.c_char_p, sz)),
        "vram_torch_pager_destroy": (None, (vp,)),
        "vram_torch_pager_acquire": (vp, (vp, sz, vp)),
        "vram_torch_pager_release": (ctypes.c_int, (vp, sz, vp)),
        "vram_torch_pager_acquire_many": (ctypes.c_int, (vp, sz, ctypes.POINTER(sz), vp,
                                                         ctypes.POINTER(vp))),
        "vram_torch_pager_release_many": (ctypes.c_int, (vp, sz, ctypes.POINTER(sz), vp)),
        "vram_torch_pager_preview": (ctypes.c_int, (sz, ctypes.POINTER(sz), ctypes.POINTER(sz),
                                                    sz, sz, sz, ctypes.POINTER(_Plan), sz,
                                                    ctypes.POINTER(ctypes.c_uint8))),
        "vram_torch_pager_error": (sz, (vp, ctypes.c_char_p, sz)),
        "vram_torch_pager_plan": (ctypes.c_int, (vp, ctypes.POINTER(_Plan), sz,
                                                 ctypes.POINTER(ctypes.c_uint8), sz)),
        "vram_torch_pager_fallback_reason": (sz, (vp, ctypes.c_char_p, sz)),
        "vram_torch_pager_stats": (ctypes.c_int, (vp, ctypes.POINTER(_Stats), sz)),
        "vram_torch_pager_reset_counters": (ctypes.c_int, (vp,)),
        "vram_torch_pager_synchronize": (ctypes.c_int, (vp,)),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise RuntimeError(f"vram_torch.offload: {name} is missing from the loaded "
                               "libvram_torch.so: rebuild it (cmake --build ... --target vram_torch)")
        fn.restype, fn.argtypes = res, args
    lib._vram_offload_bound = True
    return lib


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_bytes(value):
    """An int, or a string like "2GiB", "1.5 GB", "512M" (K/M/G alone are powers of 2)."""
    if isinstance(value, bool):
        raise TypeError("budget: a number of bytes or a string like '2GiB', not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"budget: cannot read {value!r} as bytes (e.g. 2147483648 or '2GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _round(n, a):
    return (n + a - 1) // a * a


def _error_text(lib, handle):
    size = lib.vram_torch_pager_error(handle, None, 0)
    buf = ctypes.create_string_buffer(size + 1)
    lib.vram_torch_pager_error(handle, buf, size + 1)
    return buf.value.decode("utf-8", "replace")


def _default_units(torch, root):
    """The items of ModuleLists (and of ModuleDicts / Sequentials inside the model) and the
    parameter-holding modules outside them, in registration order."""
    nn = torch.nn
    units = []

    def walk(prefix, module):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or (
                    isinstance(module, nn.Sequential) and module is not root):
                units.append((path, child))
            elif not any(True for _ in child.children()):
                if any(p is not None for p in child._parameters.values()):
                    units.append((path, child))
            else:
                if any(p is not None for p in child._parameters.values()):
                    units.append((path, child))  # its own parameters; children walked too
                walk(path, child)

    if any(p is not None for p in root._parameters.values()):
        units.append(("", root))
    walk("", root)
    return units


class _Piece:
    __slots__ = ("index", "name", "unit", "hook_paths", "tensors", "refs", "nbytes", "offset",
                 "host_params")

    def __init__(self, index, name, unit, hook_path):
        self.index, self.name, self.unit = index, name, unit
        self.hook_paths = [hook_path]  # the modules whose hooks acquire it (coalesced: several)
        self.tensors = []  # (tensor, offset in piece, nbytes)
        self.refs = []  # (dict, key, tensor index): every place a tensor is referenced
        self.nbytes = 0
        self.offset = 0
        self.host_params = []


class Offload:
    """What offload() returns (also module._vram_offload). report(), stats(),
    reset_stats(), synchronize(), remove()."""

    def __init__(self, torch, module, budget, device, units, granularity, host, prefetch_depth,
                 schedule, relearn, small_bytes, verbose, host_double, path, stall_sample_period,
                 fill_threads, coalesce=True, staging_chunk_bytes=16 << 20, staging_buffers=16):
        self._torch = torch
        nn = torch.nn
        if not isinstance(module, nn.Module):
            raise TypeError(f"vram_torch.offload: expected a torch.nn.Module, got {type(module)}")
        if getattr(module, "_vram_offload", None) is not None:
            raise ValueError("vram_torch.offload: this module is already offloaded (call "
                             "module._vram_offload.remove() first)")
        if granularity not in ("leaf", "param", "unit"):
            raise ValueError(f"vram_torch.offload: granularity must be 'leaf', 'param' or "
                             f"'unit', not "
                             f"{granularity!r}")
        if host not in _HOST_MODES:
            raise ValueError(f"vram_torch.offload: host must be one of {list(_HOST_MODES)}, "
                             f"not {host!r}")
        if not 0 <= int(prefetch_depth) <= vram_torch._SIZE_MAX:
            raise ValueError("vram_torch.offload: prefetch_depth must be >= 0 and fit a size_t")
        self._lib = _bind(vram_torch.load_library(path))
        self.module = module
        self.budget = parse_bytes(budget)
        if self.budget <= 0:
            raise ValueError(f"vram_torch.offload: budget must be positive, not {budget!r}")
        self.host_double = bool(host_double)
        if self.host_double:
            self.device = torch.device("cpu")
            self._device_index = -1
        else:
            index = vram_torch._device_index(device)
            self.device = torch.device("cuda", index)
            self._device_index = index
        self.granularity, self.host, self.prefetch_depth = granularity, host, int(prefetch_depth)
        self.relearn, self.verbose = bool(relearn), bool(verbose)
        self._stall_period, self._fill_threads = int(stall_sample_period), int(fill_threads)
        self._staging_chunk, self._staging_buffers = int(staging_chunk_bytes), int(staging_buffers)
        # A given schedule names the single pieces: they are not joined then.
        self.coalesce = bool(coalesce) and schedule is None
        self._small_bytes = int(small_bytes)
        self._handle = None
        self._hooks = []
        self._views = {}
        self._pending = {}  # piece -> stream: released by its modules, pager release deferred
        self._arrays = {}  # tuple of pieces -> (ctypes index array, pointer array)
        self._last = -1  # the piece acquired last (a joined piece's modules re-acquire it)
        self.forwards = 0
        self.out_of_order = 0
        self.order_changes = 0
        self.relearns = 0
        self.rebuild_seconds = 0.0
        self._depth = 0  # nesting of the top-level forward
        self._trace = []
        self._pos = 0
        self._candidate = None
        self._given_schedule = schedule is not None
        if self.host_double:
            self._stream = lambda: None
        else:
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is not None:
                self._stream = lambda: raw(self._device_index)
            else:
                self._stream = lambda: torch.cuda.current_stream(self.device).cuda_stream
        self._resident = []
        with torch.inference_mode(False), torch.no_grad():
            self._build(units)
            self._holds = [0] * len(self.pieces)
            self._schedule = self._initial_schedule(schedule)
            self._create_pager(self._schedule)
        self._install_hooks()
        module._vram_offload = self
        if self.verbose:
            print(self.describe(), file=sys.stderr)

    # ---- building ----------------------------------------------------------------------
    def _build(self, units):
        torch, nn = self._torch, self._torch.nn
        root = self.module
        if units is None:
            units = _default_units(torch, root)
        else:
            named = dict(root.named_modules())
            resolved = []
            for u in units:
                if isinstance(u, str):
                    if u not in named:
                        raise ValueError(f"vram_torch.offload: no submodule named {u!r}")
                    resolved.append((u, named[u]))
                else:
                    path = next((n for n, m in named.items() if m is u), None)
                    if path is None:
                        raise ValueError("vram_torch.offload: a unit is not a submodule of the "
                                         "module")
                    resolved.append((path, u))
            units = resolved
        self.units = [path for path, _ in units]
        for name, t in list(root.named_parameters()) + list(root.named_buffers()):
            if t.device.type == "meta":
                raise ValueError(f"vram_torch.offload: {name} is on the meta device (no data). "
                                 "Fix: load the weights first (e.g. from_pretrained without "
                                 "device_map='meta' / low_cpu_mem_usage tricks).")
        owner = {}  # id(param) -> piece
        pieces = []
        self.direct_bytes = 0
        self._direct = []
        module_paths = {id(m): p for p, m in root.named_modules()}

        def own_params(m):
            return [(k, p) for k, p in m._parameters.items() if p is not None]

        def new_piece(name, unit, hook_path, params):
            piece = _Piece(len(pieces), name, unit, hook_path)
            for p in params:
                if id(p) in owner or p.numel() == 0:
                    continue
                owner[id(p)] = piece
                piece.tensors.append([p, 0, p.numel() * p.element_size()])
            if piece.tensors:
                pieces.append(piece)

        def module_pieces(m, mpath, upath):
            if self.granularity == "param":
                for key, p in own_params(m):
                    new_piece(f"{mpath}.{key}" if mpath else key, upath, mpath, [p])
            else:
                new_piece(mpath or "<root>", upath, mpath, [p for _, p in own_params(m)])

        unit_of = {}
        for upath, unit in units:
            sub = [m for m in unit.modules()] if unit is not root else [root]
            for m in sub:
                unit_of.setdefault(id(m), upath)
            members = [unit] if unit is root else list(unit.modules())
            if self.granularity == "unit":
                new_piece(upath or "<root>", upath, upath,
                          [p for m in members for _, p in own_params(m)])
            else:
                for m in members:
                    if own_params(m):
                        module_pieces(m, module_paths.get(id(m), upath), upath)
        # Parameters outside every unit: a piece per module (or parameter).
        for mpath, m in root.named_modules():
            if own_params(m) and any(id(p) not in owner for _, p in own_params(m)):
                module_pieces(m, mpath, unit_of.get(id(m), mpath))

        # Small pieces and all buffers: ordinary device tensors.
        self._buffer_refs = []
        for m in root.modules():
            for key, b in m._buffers.items():
                if b is not None:
                    self._buffer_refs.append((m, key, b))
        kept = []
        for piece in pieces:
            total = sum(t[2] for t in piece.tensors)
            if total < self._small_bytes:
                for t in piece.tensors:
                    self._direct.append(t[0])
            else:
                kept.append(piece)
        seen = set()
        for p in self._direct:
            if id(p) not in seen:
                seen.add(id(p))
                self.direct_bytes += _round(p.numel() * p.element_size(), 512)
        for _, _, b in self._buffer_refs:
            if id(b) not in seen:
                seen.add(id(b))
                self.direct_bytes += _round(b.numel() * b.element_size(), 512)
        kept = self._coalesce(kept)
        for i, piece in enumerate(kept):
            piece.index = i
        self.pieces = kept
        paged = {id(t[0]): piece for piece in kept for t in piece.tensors}

        # Every reference to a paged tensor, and the modules that need a piece they do not
        # sit under (tied parameters in another piece's module).
        self._needs = {}  # id(module) -> (module, [piece index])
        for piece in kept:
            piece_refs = {id(t[0]): i for i, t in enumerate(piece.tensors)}
            for mpath, m in root.named_modules(remove_duplicate=False):
                for key, p in m._parameters.items():
                    if p is not None and id(p) in piece_refs:
                        piece.refs.append((m._parameters, key, piece_refs[id(p)]))
        named = dict(root.named_modules())
        hook_modules = {piece.index: [named[hp] if hp else root for hp in piece.hook_paths]
                        for piece in kept}
        for mpath, m in root.named_modules():
            for key, p in own_params(m):
                piece = paged.get(id(p))
                if piece is None or any(h is m for h in hook_modules[piece.index]):
                    continue
                hp = piece.hook_paths[0]
                covered = mpath == hp or (hp == "" or mpath.startswith(hp + "."))
                if covered and self.granularity == "unit":
                    continue
                entry = self._needs.setdefault(id(m), (m, []))
                if piece.index not in entry[1]:
                    entry[1].append(piece.index)
        for piece in kept:
            for m in hook_modules[piece.index]:
                entry = self._needs.setdefault(id(m), (m, []))
                if piece.index not in entry[1]:
                    entry[1].insert(0, piece.index)
        # Registration order of the hooked modules: the schedule's first guess.
        order = [id(m) for m in root.modules()]
        self._hooked = sorted(self._needs.values(), key=lambda e: order.index(id(e[0])))

        # Lay the paged tensors out in one host buffer, and refuse a budget that cannot work
        # before anything of the module changed.
        torch = self._torch
        offset = 0
        for piece in kept:
            inner = 0
            for t in piece.tensors:
                t[1] = inner
                inner = _round(inner + t[2], _TENSOR_ALIGN)
            piece.nbytes = inner
            piece.offset = offset
            offset = _round(offset + inner, _PIECE_ALIGN)
        self.host_bytes = offset
        self._check_budget()
        # Page-aligned: a piece shares no page with another (pinning registers whole pages).
        storage = torch.empty(max(offset, 1) + _PIECE_ALIGN, dtype=torch.uint8)
        shift = (-storage.data_ptr()) % _PIECE_ALIGN
        self._host = storage[shift:shift + max(offset, 1)]
        self.moved_from_device = 0
        for piece in kept:
            for i, (p, inner, n) in enumerate(piece.tensors):
                if p.device.type == "cuda":
                    self.moved_from_device += n
                start = piece.offset + inner
                view = self._host[start:start + n].view(p.dtype).view(p.shape)
                view.copy_(p.detach())
                piece.host_params.append(nn.Parameter(view, requires_grad=False))
            for d, key, i in piece.refs:
                d[key] = piece.host_params[i]
            piece.tensors = [(str(p.dtype), tuple(p.shape), p.dtype, inner, n)
                             for p, inner, n in piece.tensors]

        # Direct tensors: parameters of small pieces and every buffer, on the device.
        direct_map = {}
        for p in self._direct:
            if id(p) not in direct_map:
                direct_map[id(p)] = nn.Parameter(p.detach().to(self.device),
                                                 requires_grad=False)
        for m in root.modules():
            for key, p in list(m._parameters.items()):
                if p is not None and id(p) in direct_map:
                    m._parameters[key] = direct_map[id(p)]
        buffer_map = {}
        for m, key, b in self._buffer_refs:
            if id(b) not in buffer_map:
                buffer_map[id(b)] = b.to(self.device)
            m._buffers[key] = buffer_map[id(b)]
        self._buffer_refs = [(m, key) for m, key, _ in self._buffer_refs]

    def _coalesce(self, kept):
        """Consecutive streamed pieces of one unit joined while the join is no larger than the
        ring's slot (the largest streamed piece of the plan over the single pieces): the ring
        and the budget stay the same, and prefetch_depth pieces ahead then cover a slot's
        bytes each (a small piece no longer takes a whole slot of the lookahead)."""
        if not self.coalesce or self.granularity == "unit" or len(kept) < 2:
            return kept
        n = len(kept)
        sizes = [sum(_round(t[2], _TENSOR_ALIGN) for t in p.tensors) for p in kept]
        pager_budget = self.budget - self.direct_bytes
        if pager_budget <= 0:
            return kept  # refused by _check_budget
        plan = _Plan()
        resident = (ctypes.c_uint8 * n)()
        order = (ctypes.c_size_t * n)(*range(n))
        if self._lib.vram_torch_pager_preview(
                n, (ctypes.c_size_t * n)(*sizes), order, n, pager_budget, self.prefetch_depth,
                ctypes.byref(plan), ctypes.sizeof(plan), resident) != 0 or not plan.slot_bytes:
            return kept  # refused (reported by _check_budget), or nothing streams
        cap = plan.slot_bytes
        out, group, group_bytes, names = [], None, 0, {}
        for piece, size, res in zip(kept, sizes, resident):
            if not res and group is not None and group.unit == piece.unit and (
                    group_bytes + size <= cap):
                group.tensors.extend(piece.tensors)
                group.hook_paths.extend(h for h in piece.hook_paths if h not in group.hook_paths)
                names[id(group)].append(piece.name)
                group_bytes += size
                continue
            out.append(piece)
            group, group_bytes = (None, 0) if res else (piece, size)
            names[id(piece)] = [piece.name]
        for piece in out:
            if len(names[id(piece)]) > 1:
                piece.name = "+".join(names[id(piece)])
        return out

    def _check_budget(self):
        n = len(self.pieces)
        pager_budget = self.budget - self.direct_bytes
        if n and pager_budget <= 0:
            raise ValueError(f"vram_torch.offload: the budget ({self.budget} bytes) does not "
                             f"even hold the small tensors and buffers kept on the device "
                             f"({self.direct_bytes} bytes). Fix: raise the budget.")
        if not n:
            return
        sizes = (ctypes.c_size_t * n)(*[p.nbytes for p in self.pieces])
        least = self._lib.vram_torch_pager_min_budget(n, sizes, self.prefetch_depth)
        if least == 0:  # refused: the reason is the process's latest pager call error
            raise ValueError(f"vram_torch.offload: {_error_text(self._lib, None)}")
        if pager_budget < least:
            largest = max(p.nbytes for p in self.pieces)
            name = next(p.name for p in self.pieces if p.nbytes == largest)
            raise ValueError(
                f"vram_torch.offload: a budget of {self.budget} bytes cannot hold the pieces "
                f"that must stay resident plus a ring of {self.prefetch_depth + 1} slots "
                f"(prefetch_depth {self.prefetch_depth}; largest piece {name!r}: {largest} "
                f"bytes; {self.direct_bytes} bytes of small tensors and buffers stay on the "
                f"device): it needs at least {least + self.direct_bytes} bytes. Fix: raise the "
                f"budget, lower prefetch_depth, or use a finer granularity ('leaf', 'param').")

    def _initial_schedule(self, schedule):
        if schedule is None:
            out = []
            for _, ks in self._hooked:
                for k in ks:
                    if not out or out[-1] != k:  # a joined piece's modules follow each other
                        out.append(k)
            return out
        names = {p.name: p.index for p in self.pieces}
        out = []
        for s in schedule:
            if isinstance(s, str):
                if s not in names:
                    raise ValueError(f"vram_torch.offload: schedule names an unknown piece "
                                     f"{s!r} (pieces: handle.report()['pieces'])")
                out.append(names[s])
            elif 0 <= int(s) < len(self.pieces):
                out.append(int(s))
            else:
                raise ValueError(f"vram_torch.offload: schedule entry {s!r} out of range")
        return out

    def _create_pager(self, schedule):
        lib = self._lib
        n = len(self.pieces)
        if n == 0:
            self._handle = None
            self.plan = {n: 0 for n in _PLAN_FIELDS}
            self.plan.update(pin_seconds=0.0, upload_seconds=0.0, fallback_reason="")
            self._resident = []
            return
        pager_budget = self.budget - self.direct_bytes
        if pager_budget <= 0:
            raise ValueError(f"vram_torch.offload: the budget ({self.budget} bytes) does not "
                             f"even hold the small tensors and buffers kept on the device "
                             f"({self.direct_bytes} bytes). Fix: raise the budget.")
        base = self._host.data_ptr()
        hosts = (ctypes.c_void_p * n)(*[base + p.offset for p in self.pieces])
        sizes = (ctypes.c_size_t * n)(*[p.nbytes for p in self.pieces])
        sched = (ctypes.c_size_t * max(len(schedule), 1))(*schedule)
        opts = _Options(budget_bytes=pager_budget, prefetch_depth=self.prefetch_depth,
                        device=max(self._device_index, 0), host=_HOST_MODES[self.host],
                        host_double=1 if self.host_double else 0,
                        fill_threads=self._fill_threads,
                        staging_chunk_bytes=self._staging_chunk,
                        staging_buffers=self._staging_buffers,
                        stall_sample_period=self._stall_period)
        err = ctypes.create_string_buffer(4096)
        handle = lib.vram_torch_pager_create(n, hosts, sizes, sched, len(schedule),
                                             ctypes.byref(opts), err, len(err))
        if not handle:
            text = err.value.decode("utf-8", "replace")
            if self.direct_bytes:
                text += (f" (the pager's budget is the offload budget less "
                         f"{self.direct_bytes} bytes of small tensors and buffers kept on the "
                         f"device)")
            raise ValueError(text)
        self._handle = handle
        plan = _Plan()
        resident = (ctypes.c_uint8 * n)()
        lib.vram_torch_pager_plan(handle, ctypes.byref(plan), ctypes.sizeof(plan), resident, n)
        self.plan = {f: getattr(plan, f) for f, _ in _Plan._fields_}
        size = lib.vram_torch_pager_fallback_reason(handle, None, 0)
        buf = ctypes.create_string_buffer(size + 1)
        lib.vram_torch_pager_fallback_reason(handle, buf, size + 1)
        self.plan["fallback_reason"] = buf.value.decode("utf-8", "replace")
        self._resident = [bool(r) for r in resident]
        self._views = {}
        # Resident pieces never move: their parameters point at the device for good.
        for k, piece in enumerate(self.pieces):
            if self._resident[k]:
                ptr = lib.vram_torch_pager_acquire(handle, k, None)
                if not ptr or lib.vram_torch_pager_release(handle, k, None) != 0:
                    raise RuntimeError("vram_torch.offload: " + _error_text(lib, handle))
                views = self._make_views(k, ptr)
                for d, key, i in piece.refs:
                    d[key] = views[i]

    def _destroy_pager(self):
        if self._pending:
            try:
                self._flush()  # the releases recorded: destroy waits for them
            except RuntimeError:
                pass
        for k, piece in enumerate(self.pieces):
            if k < len(self._resident) and self._resident[k]:
                for d, key, i in piece.refs:
                    d[key] = piece.host_params[i]
        if self._handle:
            self._lib.vram_torch_pager_destroy(self._handle)
            self._handle = None
            self._views = {}

    # ---- hooks -------------------------------------------------------------------------
    def _install_hooks(self):
        torch = self._torch
        for m, pieces in self._hooked:
            pieces = tuple(pieces)
            self._hooks.append(m.register_forward_pre_hook(
                lambda mod, args, _p=pieces: self._enter(_p, args)))
            self._hooks.append(m.register_forward_hook(
                lambda mod, args, out, _p=pieces: self._exit(_p), always_call=True))
        self._hooks.append(self.module.register_forward_pre_hook(self._root_enter,
                                                                 with_kwargs=True))
        self._hooks.append(self.module.register_forward_hook(
            lambda mod, args, out: self._root_exit(), always_call=True))
        self._grad_enabled = torch.is_grad_enabled

    def _to_device(self, value):
        torch = self._torch
        if isinstance(value, torch.Tensor) and value.device != self.device:
            return value.to(self.device)
        return value

    def _root_enter(self, module, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            self._trace = []
            self._last = -1
        if self.host_double:
            return None
        return (tuple(self._to_device(a) for a in args),
                {k: self._to_device(v) for k, v in kwargs.items()})

    def _root_exit(self):
        self._depth -= 1
        if self._depth != 0:
            return
        self._last = -1
        if self._pending:
            self._flush()
        self.forwards += 1
        trace, self._trace = self._trace, []
        if not trace or trace == self._schedule:
            self._candidate = None
            return
        self.order_changes += 1
        if self.order_changes == 1 and self.forwards > 1 and self.verbose:
            print(f"vram_torch.offload: forward {self.forwards} used the pieces in another "
                  f"order than the schedule: what was not prefetched was paged in on demand "
                  f"(stats()['out_of_order']); "
                  + ("the schedule is relearned once two forwards in a row follow the same "
                     "order." if self.relearn else "relearn=False keeps the schedule."),
                  file=sys.stderr)
        if not self.relearn or any(self._holds):
            return
        first = self.forwards == 1 and not self._given_schedule
        if first or trace == self._candidate:
            self._rebuild(trace)
            self._candidate = None
        else:
            self._candidate = trace

    def _rebuild(self, schedule):
        import time

        start = time.perf_counter()
        self._destroy_pager()
        self._schedule = list(schedule)
        self._create_pager(self._schedule)
        self._pos = 0
        self.relearns += 1
        self.rebuild_seconds += time.perf_counter() - start

    def _enter(self, pieces, args):
        if self._grad_enabled():
            for a in args:
                if getattr(a, "requires_grad", False):
                    raise RuntimeError(
                        "vram_torch.offload: an input requires grad; offloaded modules are "
                        "for inference (the weights' device memory is reused as soon as the "
                        "module returns). Fix: run under torch.no_grad() or "
                        "torch.inference_mode().")
        schedule = self._schedule
        for k in pieces:
            if k == self._last:
                continue  # the same piece again (a joined piece's next module): one use
            self._last = k
            if self._depth:
                self._trace.append(k)
            pos = self._pos
            if pos < len(schedule) and schedule[pos] == k:
                self._pos = pos + 1 if pos + 1 < len(schedule) else 0
            else:
                self.out_of_order += 1
                try:
                    self._pos = (schedule.index(k, pos) + 1) % len(schedule)
                except ValueError:
                    try:
                        self._pos = (schedule.index(k) + 1) % len(schedule)
                    except ValueError:
                        pass
        # Resident pieces are bound for good: no pager call. A piece whose release is still
        # pending on this stream is taken back as it is (still bound, never released).
        resident, holds, pending = self._resident, self._holds, self._pending
        need = ()
        stream = None
        for k in pieces:
            if resident[k]:
                continue
            held = holds[k]
            if held:
                holds[k] = held + 1
                continue
            if stream is None:
                stream = self._stream()
            if pending.get(k, self) == stream:
                del pending[k]
                holds[k] = 1
            else:
                need += (k,)
        if pending:
            self._flush()  # before the acquire: their slots can take its prefetches
        if need:
            self._acquire(need, stream)

    def _acquire(self, need, stream):
        lib, handle = self._lib, self._handle
        arrays = self._arrays.get(need)
        if arrays is None:
            arrays = ((ctypes.c_size_t * len(need))(*need), (ctypes.c_void_p * len(need))())
            self._arrays[need] = arrays
        index, out = arrays
        if lib.vram_torch_pager_acquire_many(handle, len(need), index, stream, out) != 0:
            raise RuntimeError("vram_torch.offload: " + _error_text(lib, handle))
        holds, views_of, pieces = self._holds, self._views, self.pieces
        for j, k in enumerate(need):
            ptr = out[j]
            holds[k] = 1
            views = views_of.get((k, ptr))
            if views is None:
                views = self._make_views(k, ptr)
            for d, key, i in pieces[k].refs:
                d[key] = views[i]

    def _exit(self, pieces):
        # The pager release (and the host copies bound back) waits for the next module's
        # pre-hook or the end of the forward: a joined piece used by the next module too is
        # then neither released nor rebound.
        resident, holds = self._resident, self._holds
        stream = None
        for k in pieces:
            if resident[k] or holds[k] == 0:
                continue  # resident, or the pre-hook failed before acquiring it
            holds[k] -= 1
            if holds[k] == 0:
                if stream is None:
                    stream = self._stream()
                self._pending[k] = stream
        if self._depth == 0:
            self._last = -1
            if self._pending:
                self._flush()  # a module called outside the top-level forward

    def _flush(self):
        """Releases the pieces whose release is pending and binds their host copies back."""
        pending, self._pending = self._pending, {}
        lib, handle = self._lib, self._handle
        failed = None
        if handle:
            if len(pending) == 1:
                (k, stream), = pending.items()
                if lib.vram_torch_pager_release(handle, k, stream) != 0:
                    failed = _error_text(lib, handle)
            else:
                by_stream = {}
                for k, stream in pending.items():
                    by_stream.setdefault(stream, []).append(k)
                for stream, ks in by_stream.items():
                    index = (ctypes.c_size_t * len(ks))(*ks)
                    if lib.vram_torch_pager_release_many(handle, len(ks), index, stream) != 0:
                        failed = failed or _error_text(lib, handle)
        for k in pending:
            piece = self.pieces[k]
            for d, key, i in piece.refs:
                d[key] = piece.host_params[i]
        if failed is not None:
            raise RuntimeError("vram_torch.offload: " + failed)

    def _make_views(self, k, ptr):
        torch = self._torch
        piece = self.pieces[k]
        with torch.inference_mode(False):
            if self.host_double:
                raw = (ctypes.c_ubyte * piece.nbytes).from_address(ptr)
                base = torch.frombuffer(raw, dtype=torch.uint8)
            else:
                base = torch.as_tensor(_CudaBytes(ptr, piece.nbytes), device=self.device)
            views = []
            for _, shape, dtype, inner, n in piece.tensors:
                v = base[inner:inner + n].view(dtype).view(shape)
                views.append(torch.nn.Parameter(v, requires_grad=False))
        self._views[(k, ptr)] = views
        return views

    # ---- reporting ---------------------------------------------------------------------
    def report(self):
        """What offload() decided: budget, pieces, resident pieces, ring, bytes per forward."""
        unit_bytes, unit_resident = {}, {}
        for p, r in zip(self.pieces, self._resident):
            unit_bytes[p.unit] = unit_bytes.get(p.unit, 0) + p.nbytes
            unit_resident[p.unit] = unit_resident.get(p.unit, 0) + (p.nbytes if r else 0)
        return {
            "budget_bytes": self.budget,
            "device": str(self.device),
            "granularity": self.granularity,
            "host": self.host,
            "pieces": len(self.pieces),
            "paged_bytes": sum(p.nbytes for p in self.pieces),
            "largest_piece_bytes": max((p.nbytes for p in self.pieces), default=0),
            "direct_bytes": self.direct_bytes,
            "resident_pieces": sum(self._resident),
            "resident_units": [u for u in unit_bytes if unit_resident[u] == unit_bytes[u]],
            "partly_resident_units": [u for u in unit_bytes
                                      if 0 < unit_resident[u] < unit_bytes[u]],
            "streamed_units": [u for u in unit_bytes if unit_resident[u] == 0],
            "ring_slots": self.plan["slot_count"],
            "slot_bytes": self.plan["slot_bytes"],
            "prefetch_depth": self.plan["prefetch_depth"],
            "arena_bytes": self.plan["arena_bytes"],
            "resident_bytes": self.plan["resident_bytes"],
            "streamed_bytes_per_forward": self.plan["streamed_bytes_per_step"],
            "pinned": bool(self.plan["pinned"]),
            "pinned_bytes": self.plan["pinned_bytes"],
            "register_calls": self.plan["register_calls"],
            "pin_seconds": self.plan["pin_seconds"],
            "upload_seconds": self.plan["upload_seconds"],
            "fallback_reason": self.plan["fallback_reason"],
            "moved_from_device_bytes": self.moved_from_device,
            "schedule_length": len(self._schedule),
            "piece_names": [p.name for p in self.pieces],
        }

    def describe(self):
        r = self.report()
        mib = lambda b: f"{b / (1 << 20):.1f} MiB"  # noqa: E731
        return (f"vram_torch.offload: budget {mib(r['budget_bytes'])} on {r['device']}: "
                f"{r['pieces']} pieces ({r['granularity']}) of {mib(r['paged_bytes'])}, "
                f"{r['resident_pieces']} resident ({mib(r['resident_bytes'])}), ring "
                f"{r['ring_slots']} x {mib(r['slot_bytes'])} (prefetch depth "
                f"{r['prefetch_depth']}), {mib(r['direct_bytes'])} of small tensors/buffers on "
                f"the device; streams {mib(r['streamed_bytes_per_forward'])} per forward; host "
                f"weights {'pinned' if r['pinned'] else 'staged'} ({mib(r['pinned_bytes'])} "
                f"pinned in {r['register_calls']} registrations)"
                + (f"; staged because {r['fallback_reason']}" if r['fallback_reason'] else ""))

    def stats(self):
        """Counters: the pager's (page_ins, bytes_paged_in, stalls, effective_gbps, ...) and
        the module's (forwards, out_of_order acquires, order_changes, relearns)."""
        out = {}
        if self._handle:
            s = _Stats()
            self._lib.vram_torch_pager_stats(self._handle, ctypes.byref(s), ctypes.sizeof(s))
            out = {f: getattr(s, f) for f, _ in _Stats._fields_}
        out.update(forwards=self.forwards, out_of_order=self.out_of_order,
                   order_changes=self.order_changes, relearns=self.relearns,
                   rebuild_seconds=self.rebuild_seconds)
        return out

    def reset_stats(self):
        if self._handle:
            self._lib.vram_torch_pager_reset_counters(self._handle)
        self.out_of_order = self.order_changes = 0

    def synchronize(self):
        """Waits for every page-in queued so far."""
        if self._handle:
            self._lib.vram_torch_pager_synchronize(self._handle)

    def remove(self):
        """Removes the hooks, frees the pager's device memory; the parameters stay the host
        copies (ordinary CPU tensors) and the buffers stay where they are."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if any(self._holds):
            raise RuntimeError("vram_torch.offload: remove() inside a forward")
        if self._pending:
            self._flush()
        self._destroy_pager()
        self.module._vram_offload = None

    def __del__(self):
        try:
            self._destroy_pager()
        except Exception:
            pass


class _CudaBytes:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2, "strides": None}


def offload(module, budget, device=0, *, units=None, granularity="leaf", host="automatic",
            prefetch_depth=2, schedule=None, relearn=True, small_bytes=1 << 20, verbose=True,
            stall_sample_period=16, fill_threads=0, coalesce=True, staging_chunk_bytes=16 << 20,
            staging_buffers=16, host_double=False, path=None):
    """Keeps `module`'s parameters in host memory and streams what does not fit `budget`
    (bytes, or "2GiB") through vram's WeightPager on `device`. Returns an Offload handle
    (report(), stats(), remove()); see this module's docstring for the rules.

    units: submodule names (or modules) of the units; granularity: "leaf" (a piece per
    parameter-holding module) or "unit" (a piece per unit); host: "automatic" (pin, else
    stage), "pinned" (raise if pinning fails) or "pageable" (stage through pinned buffers);
    prefetch_depth: schedule positions prefetched ahead (ring of depth + 1 slots);
    schedule: the piece order of one forward (names or indices; default: learned);
    small_bytes: pieces smaller than this stay on the device as ordinary tensors;
    coalesce: join consecutive streamed pieces of a unit up to the ring's slot size (the ring
    and the budget stay the same; the prefetch then runs prefetch_depth slots of bytes ahead);
    staging_chunk_bytes, staging_buffers, fill_threads: pageable host weights are staged
    through staging_buffers pinned buffers of staging_chunk_bytes, filled by fill_threads
    threads (0: the hardware threads, at most 16), which run that many buffers ahead;
    host_double: host memory stands in for the GPU (tests of the offload path on a CPU).
    Raises ValueError when the budget cannot hold the pieces that must stay resident plus
    the ring (the message gives the least budget that works)."""
    torch = vram_torch._torch("offload()")

    return Offload(torch, module, budget, device, units, granularity, host, prefetch_depth,
                   schedule, relearn, small_bytes, verbose, host_double, path,
                   stall_sample_period, fill_threads, coalesce, staging_chunk_bytes,
                   staging_buffers)
