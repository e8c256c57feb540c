"""Sleep and wake under vram_torch.enable() (docs/sleep-wake.md): tensors allocated in
`vram_torch.region(tag)` give their GPU memory back at sleep() and come back at wake() with
their contents and addresses; a CUDA graph captured over them replays after a wake; a small
model gives the same outputs before sleep and after wake; misuse raises and changes nothing.

Free memory is read with torch.cuda.mem_get_info (what other processes see); figures are
differences around the test's own tensors, never hard-coded totals.
"""
import gc

import vram_test_util as util

torch = util.torch_with_gpu()
import vram_torch  # noqa: E402

MODE = vram_torch.enable()
MiB = util.MiB
GiB = util.GiB


def _free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _warm_up(fn):
    """Runs fn twice on a side stream before a capture, as torch.cuda.graph's docs ask."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def _expect_error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (vram_torch.SleepError, ValueError) as e:
        return str(e)
    raise AssertionError(f"{fn.__name__}{args} did not raise")


def test_contents_and_addresses_survive_and_memory_is_freed_while_asleep():
    torch.manual_seed(0)
    with vram_torch.region("t_contents"):
        tensors = [torch.randn(n, device="cuda") for n in (1, 333, 65536, 1 << 20, 50 << 20)]
        tensors += [torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device="cuda")]
    expected = [t.cpu().clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    mapped = vram_torch.tag_stats("t_contents")["mapped_bytes"]
    assert mapped >= sum(t.numel() * t.element_size() for t in tensors)
    before = _free()
    vram_torch.sleep("t_contents")
    asleep = _free()
    stats = vram_torch.tag_stats("t_contents")
    assert stats["asleep"] == 1 and stats["mapped_bytes"] == 0, stats
    assert asleep - before >= mapped * 99 // 100, (before, asleep, mapped)
    vram_torch.wake("t_contents")
    assert [t.data_ptr() for t in tensors] == pointers
    for t, e in zip(tensors, expected):
        assert torch.equal(t.cpu(), e)
    del tensors, t  # the loop variable holds the last tensor
    gc.collect()
    assert vram_torch.tag_stats("t_contents")["live_blocks"] == 0


def test_several_tags_at_once_and_a_discardable_kv_cache():
    with vram_torch.region("t_weights"):
        w = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
    with vram_torch.region("t_kv", discardable=True):
        kv = torch.empty((256 << 20,), dtype=torch.uint8, device="cuda")
    kv_ptr = kv.data_ptr()
    before = _free()
    vram_torch.sleep(["t_weights", "t_kv"])
    assert _free() - before >= (64 + 256) * MiB * 99 // 100
    assert vram_torch.tag_stats("t_kv")["backed_up_bytes"] == 0
    vram_torch.wake_up(["t_weights", "t_kv"])  # vLLM's spelling
    assert kv.data_ptr() == kv_ptr
    kv.fill_(1)  # mapped and writable again, contents undefined before
    assert int(w.min()) == 7 and int(w.max()) == 7
    assert int(kv.sum()) == 256 << 20
    del w, kv


def test_a_graph_captured_before_sleep_replays_after_wake():
    with vram_torch.region("t_graph"):
        weight = torch.randn(512, 512, device="cuda")
        static_in = torch.randn(64, 512, device="cuda")
    _warm_up(lambda: (static_in @ weight).relu())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = (static_in @ weight).relu()
    graph.replay()
    expected = static_out.clone()
    for _ in range(3):
        vram_torch.sleep("t_graph")
        vram_torch.wake("t_graph")
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, expected)
    static_in.copy_(torch.randn(64, 512, device="cuda"))
    graph.replay()
    assert torch.allclose(static_out, (static_in @ weight).relu(), atol=1e-4)
    del graph, static_out, weight, static_in


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        self.body = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(128, 1000)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def _generate(model, tokens, steps):
    out = tokens
    for _ in range(steps):
        logits = model(out)[:, -1]
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out


def test_a_graph_captured_inside_a_region_sleeps_with_its_own_memory():
    with vram_torch.region("t_graph_memory"):
        weight = torch.randn(1024, 1024, device="cuda")
        static_in = torch.randn(256, 1024, device="cuda")
        _warm_up(lambda: ((static_in @ weight).relu() @ weight).sum(dim=1))
        torch.cuda.synchronize()
        before = vram_torch.tag_stats("t_graph_memory")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # its intermediates and output: the graph's pool
            hidden = (static_in @ weight).relu()
            static_out = (hidden @ weight).sum(dim=1)
            del hidden  # freed inside the capture: held for the graph
    after = vram_torch.tag_stats("t_graph_memory")
    graph_bytes = 256 * 1024 * 4
    # The capture's blocks were taken from the tag: the hidden activations (held) and the
    # output, at least.
    assert after["live_bytes"] >= before["live_bytes"] + graph_bytes, (before, after)
    graph.replay()
    torch.cuda.synchronize()
    expected = static_out.clone()
    for _ in range(3):
        mapped = vram_torch.tag_stats("t_graph_memory")["mapped_bytes"]  # less after a wake:
        free_awake = _free()  # the granules mapped ahead are not mapped again
        vram_torch.sleep("t_graph_memory")
        asleep = _free()
        assert asleep >= free_awake + mapped * 99 // 100, (free_awake, asleep, mapped)
        vram_torch.wake("t_graph_memory")
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, expected)
    # Freed by the user while the graph lives: still the graph's, never handed out again.
    out_address = static_out.data_ptr()
    del static_out
    gc.collect()
    with vram_torch.region("t_graph_memory"):
        fresh = [torch.empty(256 * 4, dtype=torch.float32, device="cuda") for _ in range(8)]
    assert all(t.data_ptr() != out_address for t in fresh)
    del fresh
    static_in.copy_(torch.randn(256, 1024, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    del graph
    gc.collect()
    torch.cuda.synchronize()


def test_a_model_loaded_in_a_region_generates_the_same_after_wake():
    torch.manual_seed(1)
    with vram_torch.region("t_model"):
        model = _Tiny().cuda().eval()
    tokens = torch.randint(0, 1000, (2, 8), device="cuda")
    with torch.no_grad():
        before = _generate(model, tokens, 12)
        logits_before = model(tokens)
    vram_torch.sleep("t_model")
    vram_torch.wake("t_model")
    with torch.no_grad():
        after = _generate(model, tokens, 12)
        logits_after = model(tokens)
    assert torch.equal(before, after)
    assert torch.equal(logits_before, logits_after)
    del model


def test_twenty_cycles_grow_neither_gpu_nor_host_memory():
    with vram_torch.region("t_cycles"):
        tensors = [torch.full((n,), i, dtype=torch.int32, device="cuda")
                   for i, n in enumerate((1000, 1 << 16, 1 << 20, 5 << 20, 32 << 20))]
    with vram_torch.region("t_cycles_kv", discardable=True):
        kv = torch.empty((128 << 20,), dtype=torch.uint8, device="cuda")
    free_after_first = None
    backup_after_first = None
    for cycle in range(20):
        vram_torch.sleep(["t_cycles", "t_cycles_kv"])
        vram_torch.wake(["t_cycles", "t_cycles_kv"])
        if cycle == 0:
            free_after_first = _free()
            backup_after_first = vram_torch.tag_stats("t_cycles")["backup_bytes"]
    assert _free() + 4 * MiB >= free_after_first
    assert vram_torch.tag_stats("t_cycles")["backup_bytes"] == backup_after_first
    assert vram_torch.tag_stats("t_cycles")["sleeps"] == 20
    for i, t in enumerate(tensors):
        assert int(t.min()) == i and int(t.max()) == i
    del tensors, kv


def test_level_2_drops_the_weights_too_and_wake_gives_writable_memory_at_the_same_addresses():
    with vram_torch.region("t_level2_weights"):
        w = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
    with vram_torch.region("t_level2_kv", discardable=True):
        kv = torch.empty((64 << 20,), dtype=torch.uint8, device="cuda")
    pointers = (w.data_ptr(), kv.data_ptr())
    mapped = (vram_torch.tag_stats("t_level2_weights")["mapped_bytes"]
              + vram_torch.tag_stats("t_level2_kv")["mapped_bytes"])
    before = _free()
    vram_torch.sleep(["t_level2_weights", "t_level2_kv"], level=2)
    assert _free() - before >= mapped * 99 // 100, (before, mapped)
    stats = vram_torch.tag_stats("t_level2_weights")
    assert stats["asleep"] == 1 and stats["backed_up_bytes"] == 0 and stats["copies"] == 0, stats
    vram_torch.wake_up(["t_level2_weights", "t_level2_kv"])
    assert (w.data_ptr(), kv.data_ptr()) == pointers
    # Uninitialised after wake: the caller reloads the weights.
    w.copy_(torch.full((64 << 20,), 9, dtype=torch.uint8, device="cuda"))
    kv.fill_(1)
    assert int(w.min()) == 9 and int(w.max()) == 9
    assert int(kv.sum()) == 64 << 20
    # Level 1 afterwards keeps the reloaded weights again.
    vram_torch.sleep("t_level2_weights", level=1)
    vram_torch.wake("t_level2_weights")
    assert int(w.min()) == 9 and int(w.max()) == 9
    del w, kv


def test_misuse_raises_and_changes_nothing():
    with vram_torch.region("t_misuse"):
        x = torch.full((1 << 20,), 5, dtype=torch.int32, device="cuda")
    assert "awake" in _expect_error(vram_torch.wake, "t_misuse")
    vram_torch.sleep("t_misuse")
    assert "asleep" in _expect_error(vram_torch.sleep, "t_misuse")
    # A request into the sleeping tag fails; the tag stays asleep.
    try:
        with vram_torch.region("t_misuse"):
            torch.empty(1 << 20, device="cuda")
        raise AssertionError("an allocation into a sleeping tag succeeded")
    except (RuntimeError, vram_torch.SleepError) as e:
        assert "asleep" in str(e) or "asleep" in vram_torch.last_error(), e
    assert vram_torch.tag_stats("t_misuse")["asleep"] == 1
    vram_torch.wake("t_misuse")
    assert int(x.min()) == 5 and int(x.max()) == 5
    _expect_error(vram_torch.sleep, "t_never_made")
    _expect_error(vram_torch.sleep, "")
    _expect_error(vram_torch.sleep, 42)
    _expect_error(vram_torch.sleep, "t_misuse", level=3)
    _expect_error(vram_torch.sleep, "t_misuse", level=0)
    _expect_error(vram_torch.sleep, "t_misuse", level=2.0)  # whole numbers only, as vLLM's
    _expect_error(vram_torch.sleep, "t_misuse", level=True)
    _expect_error(vram_torch.sleep, "t_misuse", level="2")
    assert vram_torch.tag_stats("t_misuse")["asleep"] == 0
    _expect_error(lambda: vram_torch.region("t_misuse", discardable=True).__enter__())
    assert vram_torch.tag_stats("t_never_made") is None
    # The C entry points never crash on bad arguments.
    lib = vram_torch.load_library()
    assert lib.vram_torch_sleep(None, 0, None) == -1
    assert lib.vram_torch_sleep_discard(None, 0, None) == -1
    assert lib.vram_torch_sleep_discard(b"t_never_made", -1, None) == -1
    assert lib.vram_torch_wake(b"t_misuse", 9999, None) == -1
    assert lib.vram_torch_region_exit() == -1
    assert lib.vram_torch_region_enter(None, 0, 0) == -1
    assert lib.vram_torch_region_enter(b"x" * 10000, 0, 0) == -1
    assert lib.vram_torch_tag_stats(b"t_misuse", 0, None, 0) == -1
    del x


def test_torch_memory_saver_shapes():
    with vram_torch.region("t_tms", enable_cpu_backup=True):
        x = torch.arange(1 << 20, device="cuda")
    vram_torch.pause("t_tms")
    vram_torch.resume("t_tms")
    assert torch.equal(x, torch.arange(1 << 20, device="cuda"))
    del x


if __name__ == "__main__":
    util.run_tests(globals())
