"""Child of test_torch_distributed.py: one training run of a small MLP on one GPU through
torch.distributed (NCCL, world size 1) with PyTorch's tensor-register allocator hook on.
argv: allocator (`vram` or `torch`), wrapper (`ddp` or `fsdp2`), rendezvous port. Prints
one RESULT line (JSON) with the losses. Not a test file by itself."""
import json
import os
import sys
import traceback

MODE, KIND, PORT = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = PORT

import torch  # noqa: E402

if MODE == "vram":
    import vram_torch

    assert vram_torch.enable() == "native"
import torch.distributed as dist  # noqa: E402


def main():
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()
    if KIND == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(6):
        x = torch.randn(64, 512, device="cuda", generator=gen)
        loss = (model(x) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    stats = torch.cuda.memory_stats()
    print("RESULT " + json.dumps({"mode": MODE, "kind": KIND, "losses": losses,
                                  "all_reduce": float(total.item()),
                                  "peak_allocated": stats["allocated_bytes.all.peak"]}),
          flush=True)


try:
    main()
except Exception as e:  # noqa: BLE001
    print("RESULT " + json.dumps({"mode": MODE, "kind": KIND, "error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc()[-2000:]}), flush=True)
    sys.exit(1)
