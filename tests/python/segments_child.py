"""Child of test_torch_segments.py: NCCL's all_reduce on one GPU (world size 1) under
vram_torch.enable() with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1: PyTorch registers
the segments of the snapshot when the communicator starts (device_id: at once), then each
segment_alloc, and deregisters at each segment_free. Tensors are allocated after the
communicator started (the pool grows: segments NCCL registers through the hook), reduced,
freed and given back (empty_cache: NCCL deregisters them), and allocated and reduced again.
argv: rendezvous port. Prints one RESULT line (JSON). Not a test file by itself."""
import json
import os
import sys
import traceback

PORT = sys.argv[1]
os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = PORT

import torch  # noqa: E402
import vram_torch  # noqa: E402

MODE = vram_torch.enable()
import torch.distributed as dist  # noqa: E402

MiB = 1 << 20


def reduce_round(sizes, seed):
    """Allocates tensors of `sizes` bytes, all_reduces them, returns how many came out wrong."""
    tensors = []
    for i, n in enumerate(sizes):
        t = torch.empty(n // 4, dtype=torch.float32, device="cuda")
        t.fill_(float(seed + i))
        tensors.append(t)
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    wrong = sum(0 if bool((t == float(seed + i)).all()) else 1 for i, t in enumerate(tensors))
    return wrong, tensors


def main():
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    sizes = [4096, 300 * 1024, 3 * MiB, 24 * MiB] + [64 * MiB] * 6 + [200 * MiB]
    wrong, tensors = reduce_round(sizes, 1)
    torch.cuda.synchronize()
    del tensors
    torch.cuda.empty_cache()  # the segments go back: NCCL deregisters them first
    wrong2, tensors = reduce_round(list(reversed(sizes)), 100)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    del tensors
    torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    actions = [e["action"] for e in trace]
    print("RESULT " + json.dumps({"mode": MODE, "wrong": wrong + wrong2,
                                  "segment_alloc_after_init": actions.count("segment_alloc"),
                                  "segment_free": actions.count("segment_free"),
                                  "last_error": vram_torch.last_error()}), flush=True)


try:
    main()
except Exception as e:  # noqa: BLE001
    print("RESULT " + json.dumps({"error": repr(e), "trace": traceback.format_exc()}),
          flush=True)
    sys.exit(1)
