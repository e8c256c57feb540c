"""vram_torch.offload: a model larger than its device budget, paged by vram's WeightPager.
Generated tokens (greedy, Hugging Face generate) and outputs identical to the all-resident
model, with PyTorch's allocator (this process) and with vram as PyTorch's allocator (a
child process: the allocator is chosen once per process). The checks: offload_checks.py."""
import vram_test_util as util

if not __import__("os").environ.get("VRAM_OFFLOAD_HOST_DOUBLE"):
    util.torch_with_gpu()
import offload_checks as checks  # noqa: E402

for _name in checks.CHECKS:
    globals()["test_" + _name[len("check_"):]] = getattr(checks, _name)


def test_all_checks_with_vram_as_the_allocator():
    proc = util.run_child("offload_checks.py", "vram", timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    passed = [line for line in proc.stdout.splitlines() if line.startswith("PASS ")]
    assert len(passed) == len(checks.CHECKS), proc.stdout


if __name__ == "__main__":
    util.run_tests(dict(globals()))
