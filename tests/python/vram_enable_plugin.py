"""A pytest plugin that makes vram PyTorch's CUDA allocator before any test module is
imported (`python -m pytest -p vram_enable_plugin ...`, with python/ on PYTHONPATH): how
run_pytorch_tests.py runs PyTorch's own test files over vram."""
import vram_torch

_MODE = vram_torch.enable()
if _MODE != "native":
    raise RuntimeError(f"vram_torch.enable() gave mode {_MODE!r}; PyTorch's tests need the "
                       "native allocator (a library built against the installed Torch)")


def pytest_report_header(config):
    import torch

    return f"vram: PyTorch's CUDA allocator is {torch.cuda.memory.get_allocator_backend()!r}"
