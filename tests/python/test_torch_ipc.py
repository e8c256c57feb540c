"""CUDA tensors shared between processes (torch.multiprocessing) under vram_torch.enable()
(one GPU, two processes): with cudaMalloc segments (VRAM_TORCH_VIRTUAL_MEMORY=0) a consumer
reads the producer's tensors right and its in-place writes reach the producer; over CUDA
virtual memory (the default) sharing fails at once with vram's message naming the fix."""
import json

import vram_test_util as util

torch = util.torch_with_gpu()


def _results(mode, virtual_memory):
    proc = util.run_child("ipc_child.py", mode, timeout=300,
                          env={"VRAM_TORCH_VIRTUAL_MEMORY": virtual_memory})
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    return proc, rows


def test_shared_tensors_read_back_right_with_cudamalloc_segments():
    proc, rows = _results("producer", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = [r for r in rows if r["case"] != "exit"]
    assert len(cases) == 4, rows
    for row in cases:
        assert row["consumer_read_ok"] and row["doubled_ok"], row
    assert rows[-1] == {"case": "exit", "exitcode": 0}, rows


def test_sharing_a_block_over_virtual_memory_is_refused_with_the_fix():
    proc, rows = _results("refused", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rows and rows[0]["raised"] == "RuntimeError", rows
    assert "VRAM_TORCH_VIRTUAL_MEMORY=0" in rows[0]["text"], rows


if __name__ == "__main__":
    util.run_tests(globals())
