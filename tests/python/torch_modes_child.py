"""Child of test_torch_stats.py: `late_enable` or `mem_pool`; prints RESULT lines (JSON).
Not a test file by itself."""
import json
import sys

import torch

import vram_torch

MiB = 1 << 20


def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


mode = sys.argv[1]
if mode == "late_enable":
    torch.ones(1, device="cuda")  # initialises CUDA and PyTorch's own allocator
    try:
        vram_torch.enable()
        result(mode=mode, raised=None, text="")
    except Exception as e:  # noqa: BLE001
        result(mode=mode, raised=type(e).__name__, text=str(e))
    # The process still works with PyTorch's allocator.
    result(mode=mode + "_after", ok=bool((torch.ones(8, device="cuda") * 2 == 2).all().item()))
elif mode == "mem_pool":
    before = vram_torch.stats()
    pool = vram_torch.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.full((64 * MiB // 4,), 3.0, device="cuda")  # 64 MiB inside the pool
        y = x * 2
    inside = vram_torch.stats()
    torch_stats = torch.cuda.memory_stats()  # PyTorch's stats keep working around vram
    ok = bool((y == 6.0).all().item())
    z = torch.ones(MiB, device="cuda")  # outside the pool: PyTorch's own segments
    outside = vram_torch.stats()
    result(mode=mode, ok=ok, vram_reserved_before=before["reserved_bytes.all.current"],
           vram_reserved_inside=inside["reserved_bytes.all.current"],
           vram_allocs_inside=inside["allocation.all.allocated"],
           vram_allocs_outside=outside["allocation.all.allocated"],
           torch_reserved=torch_stats.get("reserved_bytes.all.current", -1),
           torch_allocated=torch_stats.get("allocated_bytes.all.current", -1))
    del x, y, z
    torch.cuda.synchronize()
    del pool
    torch.cuda.empty_cache()
    result(mode=mode + "_released", vram_reserved=vram_torch.stats()["reserved_bytes.all.current"],
           vram_in_use=vram_torch.stats()["allocated_bytes.all.current"])
else:
    raise SystemExit(f"unknown mode {mode}")
