"""Child of test_torch_oom.py: runs with vram as PyTorch's allocator and prints one
RESULT line per step (JSON), for the parent to check. Not a test file by itself."""
import json
import sys

import torch

import vram_torch

vram_torch.enable()
GiB = 1 << 30


def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def try_alloc(nbytes):
    """Allocates nbytes without launching a kernel on it (a null pointer must never reach a
    kernel: it would corrupt the context)."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        return None, "torch.OutOfMemoryError", str(e)
    except Exception as e:  # noqa: BLE001: the kind is what the parent checks
        return None, type(e).__module__ + "." + type(e).__qualname__, str(e)
    if t.data_ptr() == 0:
        return t, "null tensor", "PyTorch accepted a null pointer from the allocator"
    return t, None, ""


total = torch.cuda.get_device_properties(0).total_memory
keep = torch.ones(1 << 20, device="cuda")  # a live tensor that must survive

# 1. One request larger than the whole device.
t, kind, text = try_alloc(2 * total)
result(step="too_large", kind=kind, text=text[:400])
del t

# 2. Fill the device in 4 GiB tensors until it runs out, then free them all.
blocks = []
kind2, text2 = None, ""
for _ in range(int(total // (4 * GiB)) + 8):
    t, kind2, text2 = try_alloc(4 * GiB)
    if kind2 is not None:
        break
    blocks.append(t)
filled = len(blocks) * 4 * GiB
result(step="fill", kind=kind2, text=text2[:400], filled_bytes=filled)
del blocks, t
vram_torch.empty_cache()

# 3. The process keeps working: a large allocation and real kernels after the failures.
stats = vram_torch.stats()
after, kind3, text3 = try_alloc(total // 2)
ok_compute = False
if kind3 is None:
    after.fill_(3)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    ok_compute = bool(((x * 2 + keep) == (torch.arange(1 << 20, dtype=torch.float32) * 2 + 1)
                       .cuda()).all().item()) and int(after[-1].item()) == 3
torch.cuda.synchronize()
result(step="after", kind=kind3, text=text3[:400], compute_ok=ok_compute,
       num_ooms=stats["num_ooms"], reserved_after_empty_cache=stats["reserved_bytes.all.current"],
       last_error=vram_torch.last_error()[:400])
sys.exit(0)
