"""Shared by the tests of tests/python (each test file runs in its own process: the CUDA
allocator can be chosen only once per process, before CUDA starts).

Run a file directly (`python3 test_x.py`) or with pytest. Without a usable GPU a file is
skipped, unless VRAM_REQUIRE_GPU=1, where that is a failure (a GPU run never passes by
skipping).
"""
import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

MiB = 1 << 20
GiB = 1 << 30
SLEEP_CYCLES = 500_000_000  # torch.cuda._sleep: ~0.25 s at 2 GHz; host work between is us


def gpu_required():
    return os.environ.get("VRAM_REQUIRE_GPU") == "1"


def skip_module(reason):
    """Skips the calling test module (pytest) or exits 0 with SKIPPED (plain run)."""
    if gpu_required():
        raise AssertionError(f"VRAM_REQUIRE_GPU=1 but the test cannot run: {reason}")
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason, allow_module_level=True)
    print(f"SKIPPED: {reason}")
    sys.exit(0)


def torch_with_gpu():
    """Imports torch and checks for a GPU without initialising CUDA."""
    try:
        import torch
    except ImportError as e:
        skip_module(f"torch is not installed ({e})")
    if not torch.cuda.is_available():
        skip_module("no CUDA device visible to torch")
    return torch


def run_tests(namespace):
    """Plain-run entry: runs every test_* function of the module in definition order."""
    tests = [(name, fn) for name, fn in namespace.items()
             if name.startswith("test_") and callable(fn)]
    failed = 0
    for name, fn in tests:
        try:
            fn()
            print(f"PASS {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{len(tests) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


def run_child(script, *args, timeout=180, env=None):
    """Runs tests/python/<script> in a fresh interpreter; returns CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python"), HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if env:
        full_env.update(env)
    result = subprocess.run([sys.executable, os.path.join(HERE, script), *args],
                            capture_output=True, text=True, timeout=timeout, env=full_env)
    print(f"--- {script} {' '.join(args)}: rc {result.returncode}\n--- stdout:\n{result.stdout}"
          f"--- stderr:\n{result.stderr}", flush=True)
    return result


def child_result(proc, label):
    """The last `RESULT {json}` line of a child run by run_child, asserted present, error-free
    and from a child that exited 0."""
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert rows, f"{label}: no result, rc {proc.returncode}\n{proc.stderr[-3000:]}"
    row = rows[-1]
    assert "error" not in row, f"{label}: {row['error']}\n{row.get('trace', '')}"
    assert proc.returncode == 0, proc.stderr[-2000:]
    return row
