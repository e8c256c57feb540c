"""torch.distributed on one GPU over vram as PyTorch's allocator: init_process_group("nccl")
with world size 1 and TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, a DDP and an FSDP2
training run (distributed_child.py, one process per allocator); the losses must equal those
of PyTorch's own allocator."""
import socket

import vram_test_util as util

torch = util.torch_with_gpu()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(mode, kind):
    proc = util.run_child("distributed_child.py", mode, kind, _free_port(), timeout=240)
    return util.child_result(proc, f"{kind} ({mode})")


def _compare(kind):
    vram, peer = _run("vram", kind), _run("torch", kind)
    print(f"{kind}: vram losses {vram['losses']}, PyTorch's allocator {peer['losses']}")
    assert vram["all_reduce"] == 1.0
    assert vram["losses"] == peer["losses"], (vram["losses"], peer["losses"])
    assert vram["losses"][-1] < vram["losses"][0]


def test_ddp_one_gpu_trains_like_pytorchs_allocator():
    _compare("ddp")


def test_fsdp2_one_gpu_trains_like_pytorchs_allocator():
    _compare("fsdp2")


if __name__ == "__main__":
    util.run_tests(globals())
