"""Stream safety of vram as PyTorch's allocator: no block is handed to another stream while
queued work still writes it.

Each test queues, on one stream, a long sleep kernel and then a write of a pattern into a
tensor, frees the tensor from the host while that work is still pending, allocates a tensor
of the same size on another stream and fills it. If the allocator handed the old block out
too early, the late pattern write lands in the new tensor and its values show it.
"""
import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

vram_torch.enable()

N = (64 * util.MiB) // 4  # float32 elements: a 64 MiB block


def _new_on(stream):
    with torch.cuda.stream(stream):
        return torch.empty(N, device="cuda")


def test_record_stream_hook_is_registered():
    assert vram_torch.record_stream_hook, (
        "PyTorch's allocator object has no set_record_stream_fn: record_stream would be "
        "ignored and the record_stream test below is expected to fail")


def test_record_stream_delays_reuse_by_another_stream():
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = _new_on(main)  # allocated (and later freed) with the main stream
    x.fill_(0.0)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(util.SLEEP_CYCLES)
        x.fill_(1.0)  # the late write: after the sleep, on the side stream
    x.record_stream(side)
    calls = vram_torch.stats()["vram.record_stream_calls"]
    assert calls >= 1, f"record_stream did not reach vram (calls={calls})"
    old_ptr = x.data_ptr()
    del x  # freed on main while the side stream still sleeps
    held = vram_torch.stats()["vram.held_back_blocks"]
    y = _new_on(main)
    y.fill_(2.0)
    aliased = y.data_ptr() == old_ptr
    torch.cuda.synchronize()
    ones = int((y == 1.0).sum().item())
    print(f"held back at free: {held}; new tensor aliases the freed block: {aliased}; "
          f"elements overwritten by the late write: {ones}")
    assert ones == 0 and bool((y == 2.0).all().item()), (
        f"{ones} elements of the new tensor were overwritten by the side stream's late write: "
        "the block was reused before the recorded stream's work completed")
    assert held >= 1, "the freed block was not held back for the recorded stream"
    # After the side stream completed, the held-back block returns to the pool.
    z = _new_on(main)
    del z
    assert vram_torch.stats()["vram.held_back_blocks"] == 0


def test_block_freed_on_side_stream_is_not_reused_early_by_main():
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        a = torch.empty(N, device="cuda")  # allocated and freed with the side stream
        torch.cuda._sleep(util.SLEEP_CYCLES)
        a.fill_(1.0)
        old_ptr = a.data_ptr()
        del a  # stream-ordered free: reusable at once on side, on main only after the fill
    b = _new_on(main)
    b.fill_(2.0)
    aliased = b.data_ptr() == old_ptr
    torch.cuda.synchronize()
    ones = int((b == 1.0).sum().item())
    print(f"main-stream tensor aliases the block freed on the side stream: {aliased}; "
          f"elements overwritten: {ones}")
    assert ones == 0 and bool((b == 2.0).all().item()), (
        f"{ones} elements overwritten: a block freed with the side stream was handed to the "
        "main stream before the side stream's queued work completed")


def test_same_stream_reuse_keeps_values_in_order():
    main = torch.cuda.current_stream()
    checks = []
    for i in range(8):
        t = _new_on(main)
        t.fill_(float(i))
        checks.append((t == float(i)).all())  # evaluated on main, in order
        del t  # reusable at once on main: the next fill is ordered after this check
    assert all(bool(c.item()) for c in checks), [bool(c.item()) for c in checks]
    stats = vram_torch.stats()
    assert stats["allocation.all.current"] >= 0
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]


def test_many_streams_with_record_stream_and_empty_cache():
    streams = [torch.cuda.Stream() for _ in range(4)]
    main = torch.cuda.current_stream()
    kept = []
    for round_ in range(3):
        tensors = []
        for s in streams:
            t = _new_on(main)
            t.fill_(-1.0)
            s.wait_stream(main)
            with torch.cuda.stream(s):
                torch.cuda._sleep(util.SLEEP_CYCLES // 10)
                t.add_(float(round_ + 2))
            t.record_stream(s)
            tensors.append(t)
        del tensors  # all freed while the side streams still run
        fresh = [_new_on(main).fill_(7.0) for _ in streams]
        kept.extend(fresh)
    torch.cuda.synchronize()
    for t in kept:
        assert bool((t == 7.0).all().item()), "a fresh tensor was overwritten by a side stream"
    del kept
    vram_torch.empty_cache()
    s = vram_torch.stats()
    assert s["vram.held_back_blocks"] == 0 and s["vram.held_back_bytes"] == 0, s


if __name__ == "__main__":
    util.run_tests(globals())
