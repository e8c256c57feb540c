"""Child of test_torch_ipc.py. `producer`: vram_torch.enable(), shares CUDA tensors with a
consumer process (torch.multiprocessing, spawn) that checks and doubles them in place; the
producer then reads the doubled values. `refused`: sharing a block over CUDA virtual memory
must fail at once with vram's message. Prints RESULT lines (JSON). Not a test file."""
import json
import sys


def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def consumer(inbox, outbox):
    import torch

    while True:
        item = inbox.get()
        if item is None:
            return
        name, tensor, expected_sum = item
        ok = float(tensor.double().sum().item()) == expected_sum
        tensor.mul_(2)
        torch.cuda.synchronize()
        outbox.put((name, ok))


def producer():
    import torch
    import vram_torch

    vram_torch.enable()
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=consumer, args=(inbox, outbox))
    worker.start()
    cases = {
        "4 KiB": torch.arange(1024, dtype=torch.float32, device="cuda"),
        "64 MiB": torch.arange(16 << 20, dtype=torch.float32, device="cuda"),
        "view at an offset": torch.arange(1 << 20, dtype=torch.float32, device="cuda")[1000:3000],
        "bf16 2-D transpose": torch.arange(512 * 256, device="cuda").reshape(512, 256).t()
                                   .to(torch.bfloat16),
    }
    for name, tensor in cases.items():
        expected = tensor.double() * 2
        inbox.put((name, tensor, float(tensor.double().sum().item())))
        got_name, read_ok = outbox.get(timeout=120)
        torch.cuda.synchronize()
        result(case=got_name, consumer_read_ok=read_ok,
               doubled_ok=bool(torch.equal(tensor.double(), expected)))
    inbox.put(None)
    worker.join(timeout=60)
    result(case="exit", exitcode=worker.exitcode)


def refused():
    import torch
    import vram_torch
    from multiprocessing.reduction import ForkingPickler

    vram_torch.enable()
    x = torch.ones(16 << 20, device="cuda")  # 64 MiB: the virtual-memory large tier
    try:
        ForkingPickler.dumps(x)
        result(case="refused", raised=None, text="")
    except Exception as e:  # noqa: BLE001
        result(case="refused", raised=type(e).__name__, text=str(e)[:500])


if __name__ == "__main__":
    {"producer": producer, "refused": refused}[sys.argv[1]]()
