"""vram_torch.stats(), empty_cache(), reset_peak(), the enable() guard and the MemPool form.

Figures are checked against what the test itself allocated (differences of the counters),
never against hard-coded totals: PyTorch may allocate workspaces of its own."""
import json

import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

vram_torch.enable()
MiB = util.MiB


def test_stats_before_first_allocation_are_zero_and_named_like_torch():
    s = vram_torch.stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "reserved_bytes.all.peak",
                "requested_bytes.all.current", "allocation.all.current", "num_ooms",
                "num_alloc_retries", "num_device_alloc", "num_device_free"):
        assert key in s, key
        assert isinstance(s[key], int) and s[key] >= 0, (key, s[key])


def test_counters_follow_allocations_and_frees():
    torch.cuda.synchronize()
    before = vram_torch.stats()
    sizes = [1000, 4 * MiB, 5 * MiB + 7, 300 * MiB]
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    during = vram_torch.stats()
    d = lambda key: during[key] - before[key]  # noqa: E731
    assert d("requested_bytes.all.current") == sum(sizes), (d("requested_bytes.all.current"),
                                                            sizes)
    assert d("allocated_bytes.all.current") == sum(vram_torch.block_bytes(n) for n in sizes)
    assert d("allocation.all.current") == len(sizes)
    assert during["allocated_bytes.all.peak"] >= during["allocated_bytes.all.current"]
    assert during["reserved_bytes.all.current"] >= during["allocated_bytes.all.current"]
    assert during["reserved_bytes.all.peak"] >= during["reserved_bytes.all.current"]
    assert during["num_device_alloc"] >= before["num_device_alloc"]
    del tensors
    after = vram_torch.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert after["allocation.all.freed"] - before["allocation.all.freed"] == len(sizes)
    assert after["allocated_bytes.all.peak"] >= during["allocated_bytes.all.current"]


def _grown_then_freed():
    """A tensor that no cached memory can hold, freed again. After an empty_cache, memory in
    a run that still holds a live tensor (of an earlier test in this process, say) stays
    cached: a run is unmapped only whole. The tensor asks for 256 MiB more than all of that,
    so at least 256 MiB are mapped for it. Returns the stats before it and while it lived."""
    vram_torch.empty_cache()
    before = vram_torch.stats()
    x = torch.empty(before["vram.cached_bytes"] + 256 * MiB, dtype=torch.uint8, device="cuda")
    grown = vram_torch.stats()
    assert grown["reserved_bytes.all.current"] >= before["reserved_bytes.all.current"] + 256 * MiB
    del x
    torch.cuda.synchronize()
    return before, grown


def test_empty_cache_returns_cached_memory_and_reset_peak_restarts_peaks():
    before, grown = _grown_then_freed()
    cached = vram_torch.stats()
    assert cached["reserved_bytes.all.current"] == grown["reserved_bytes.all.current"]
    vram_torch.empty_cache()
    emptied = vram_torch.stats()
    print(f"after empty_cache: reserved {emptied['reserved_bytes.all.current']}, allocated "
          f"{emptied['allocated_bytes.all.current']}, cached {emptied['vram.cached_bytes']}, "
          f"held back {emptied['vram.held_back_bytes']}")
    # Every byte mapped for the tensor went back.
    assert emptied["reserved_bytes.all.current"] <= before["reserved_bytes.all.current"]
    assert emptied["num_device_free"] > cached["num_device_free"]
    assert emptied["reserved_bytes.all.peak"] >= grown["reserved_bytes.all.current"]
    vram_torch.reset_peak()
    reset = vram_torch.stats()
    assert reset["reserved_bytes.all.peak"] == reset["reserved_bytes.all.current"], reset
    assert reset["allocated_bytes.all.peak"] == reset["allocated_bytes.all.current"], reset


def test_torch_cuda_empty_cache_reaches_vram():
    before, grown = _grown_then_freed()
    torch.cuda.empty_cache()  # PyTorch -> set_reset_fn hook -> vram_torch_empty_cache_all
    after = vram_torch.stats()["reserved_bytes.all.current"]
    assert after <= before["reserved_bytes.all.current"], (before, grown, after)
    assert after <= grown["reserved_bytes.all.current"] - 256 * MiB, (grown, after)


def _child_results(mode):
    proc = util.run_child("torch_modes_child.py", mode)
    assert proc.returncode == 0, f"torch_modes_child.py {mode} exited with {proc.returncode}"
    return {r["mode"]: r for r in (json.loads(line[7:]) for line in proc.stdout.splitlines()
                                   if line.startswith("RESULT "))}


def test_enable_after_cuda_init_is_a_clear_error():
    r = _child_results("late_enable")
    assert r["late_enable"]["raised"] == "RuntimeError", r
    assert "before CUDA is initialised" in r["late_enable"]["text"], r
    assert r["late_enable_after"]["ok"] is True, r


def test_mem_pool_form_uses_vram_segments_and_keeps_torch_stats():
    r = _child_results("mem_pool")
    inside, released = r["mem_pool"], r["mem_pool_released"]
    assert inside["ok"] is True, inside
    assert inside["vram_reserved_inside"] >= 64 * MiB > inside["vram_reserved_before"], inside
    assert inside["vram_allocs_inside"] >= 1, inside
    assert inside["vram_allocs_outside"] == inside["vram_allocs_inside"], (
        "an allocation outside use_mem_pool reached vram", inside)
    assert inside["torch_reserved"] >= 64 * MiB, inside
    # Whether PyTorch hands a released MemPool's segments back at once is PyTorch's policy:
    # reported, not asserted.
    print(f"after releasing the MemPool: {released}")


if __name__ == "__main__":
    util.run_tests(globals())
