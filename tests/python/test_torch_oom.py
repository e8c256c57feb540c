"""Out of memory with vram as PyTorch's allocator: PyTorch's OutOfMemoryError, vram's
explanation on stderr (once), and a process that keeps working afterwards. Runs in a child
process (oom_child.py) so its stderr can be checked."""
import json

import vram_test_util as util

util.torch_with_gpu()


def _results(proc):
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT "):])
            out[item["step"]] = item
    return out


_proc = None


def _child():
    global _proc
    if _proc is None:
        _proc = util.run_child("oom_child.py", timeout=240)
    return _proc


def test_child_completes():
    proc = _child()
    assert proc.returncode == 0, f"oom_child.py exited with {proc.returncode}"
    assert set(_results(proc)) == {"too_large", "fill", "after"}, _results(proc)


def test_too_large_request_raises_torch_oom():
    r = _results(_child()).get("too_large", {})
    assert r.get("kind") == "torch.OutOfMemoryError", (
        f"allocating twice the device gave {r.get('kind')!r} ({r.get('text')!r}), "
        "not torch.OutOfMemoryError")


def test_filling_the_device_ends_in_torch_oom():
    r = _results(_child()).get("fill", {})
    assert r.get("kind") == "torch.OutOfMemoryError", r
    assert r.get("filled_bytes", 0) > 0, "not even one 4 GiB tensor fitted"


def test_vram_explanation_printed_once():
    err = _child().stderr
    header = "vram_torch: out of device memory"
    assert err.count(header) == 1, (
        f"expected vram's explanation exactly once on stderr, found {err.count(header)}")
    assert "vram:" in err, "the explanation line is missing"


def test_process_keeps_working_after_oom():
    r = _results(_child()).get("after", {})
    assert r.get("kind") is None, f"allocation after the OOMs failed: {r}"
    assert r.get("compute_ok") is True, r
    assert r.get("num_ooms", 0) >= 2, r
    assert r.get("last_error"), "vram_torch.last_error() is empty after an OOM"


if __name__ == "__main__":
    util.run_tests(globals())
