"""The checks of vram_torch.offload, shared by test_torch_offload.py (PyTorch's allocator,
in its own process) and run as a child with vram as PyTorch's allocator:

    python3 offload_checks.py vram      # vram_torch.enable() first, then every check

Each check compares an offloaded model with an all-resident copy of it: generated tokens
(greedy) and outputs must be identical. VRAM_OFFLOAD_HOST_DOUBLE=1 runs them on the CPU with
host memory standing in for the GPU (the offload path without a GPU).
"""
import copy
import os
import sys
import traceback

HOST_DOUBLE = os.environ.get("VRAM_OFFLOAD_HOST_DOUBLE") == "1"
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "vram":
    import vram_torch

    vram_torch.enable()  # before anything initialises CUDA

import torch  # noqa: E402
import vram_torch  # noqa: E402

nn = torch.nn
DEV = torch.device("cpu") if HOST_DOUBLE else torch.device("cuda", 0)


def offload(model, budget, **kw):
    kw.setdefault("small_bytes", 4096)
    kw.setdefault("verbose", False)
    return vram_torch.offload(model, budget, 0, host_double=HOST_DOUBLE, **kw)


def allocated():
    if HOST_DOUBLE:
        return 0
    if vram_torch.is_enabled():
        return vram_torch.stats()["allocated_bytes.all.current"]
    return torch.cuda.memory_allocated(DEV)


def llama(tied, layers=4, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                      tie_word_embeddings=tied, pad_token_id=0, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def model_bytes(model):
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def generate(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)


def prompts():
    g = torch.Generator().manual_seed(5)
    out = []
    for batch, seq, new in ((1, 7, 9), (3, 19, 5), (2, 33, 12), (1, 7, 9)):
        ids = torch.randint(1, 1000, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        if batch == 3:  # left padding in one row
            ids[1, :4] = 0
            mask[1, :4] = 0
        out.append((ids.to(DEV), mask.to(DEV), new))
    return out


def check_generate(tied, granularity="leaf", host="automatic", depth=2, fraction=0.4):
    model = llama(tied)
    ref = copy.deepcopy(model).to(DEV)
    budget = int(model_bytes(model) * fraction)
    handle = offload(model, budget, granularity=granularity, host=host, prefetch_depth=depth)
    report = handle.report()
    assert report["streamed_bytes_per_forward"] > 0, report
    assert report["arena_bytes"] <= budget - report["direct_bytes"], report
    assert report["ring_slots"] == depth + 1, report
    if tied:
        # The tied weight is stored once: lm_head has no piece of its own.
        assert not any(n == "lm_head" for n in report["piece_names"]), report["piece_names"]
    for i, (ids, mask, new) in enumerate(prompts()):
        mode = torch.no_grad() if i % 2 == 0 else torch.inference_mode()
        with mode:
            want = generate(ref, ids, mask, new)
            got = generate(model, ids, mask, new)
        assert torch.equal(got, want), (i, got, want)
    stats = handle.stats()
    assert stats["page_ins"] > 0 and stats["bytes_paged_in"] > 0, stats
    assert stats["forwards"] == sum(new for _, _, new in prompts()), stats
    # Llama's forward follows the registration order: the schedule needed no relearning.
    assert stats["out_of_order"] == 0 and stats["relearns"] == 0, stats
    handle.remove()
    return report, stats


def check_generate_untied():
    check_generate(False)


def check_generate_tied():
    check_generate(True)


def check_unit_granularity():
    check_generate(False, granularity="unit", depth=1, fraction=0.6)


def check_param_granularity():
    check_generate(True, granularity="param")


def check_pageable_host():
    report, stats = check_generate(False, host="pageable")
    assert not report["pinned"], report
    assert report["fallback_reason"] == "", report


def check_pinned_host():
    report, _ = check_generate(False, host="pinned")
    if not HOST_DOUBLE:
        assert report["pinned"] and report["pinned_bytes"] > 0, report


def check_joined_pieces():
    """Consecutive streamed pieces of a layer are joined up to the ring's slot size: fewer
    pieces, the same ring; tokens identical to the single pieces' and to all-resident, and a
    joined piece is taken once per forward by its modules (no out-of-order acquire)."""
    model = llama(False, seed=4)
    ref = copy.deepcopy(model).to(DEV)
    single = copy.deepcopy(model)
    budget = int(model_bytes(model) * 0.4)
    alone = offload(single, budget, coalesce=False)
    joined = offload(model, budget)
    a, j = alone.report(), joined.report()
    assert j["pieces"] < a["pieces"], (a["pieces"], j["pieces"])
    assert any("+" in n for n in j["piece_names"]), j["piece_names"]
    assert not any("+" in n for n in a["piece_names"]), a["piece_names"]
    assert j["ring_slots"] == a["ring_slots"] and j["slot_bytes"] <= a["slot_bytes"], (a, j)
    assert j["arena_bytes"] <= budget - j["direct_bytes"], j
    for i, (ids, mask, new) in enumerate(prompts()[:3]):
        mode = torch.no_grad() if i % 2 == 0 else torch.inference_mode()
        with mode:
            want = generate(ref, ids, mask, new)
            assert torch.equal(generate(model, ids, mask, new), want), i
            assert torch.equal(generate(single, ids, mask, new), want), i
    s = joined.stats()
    assert s["page_ins"] > 0 and s["out_of_order"] == 0 and s["relearns"] == 0, s
    # After a forward no piece is held and no release is left pending.
    assert not joined._pending and not any(joined._holds), (joined._pending, joined._holds)
    alone.remove()
    joined.remove()


def check_budget_too_small_refused():
    model = llama(False)
    before = {n: (id(p), p.device) for n, p in model.named_parameters()}
    try:
        offload(model, 100_000)
    except ValueError as e:
        text = str(e)
        assert "needs at least" in text and "largest piece" in text, text
    else:
        raise AssertionError("a budget below the largest piece plus the ring was accepted")
    # Nothing of the module changed.
    assert before == {n: (id(p), p.device) for n, p in model.named_parameters()}
    assert getattr(model, "_vram_offload", None) is None
    for bad in (0, -5, "lots"):
        try:
            offload(model, bad)
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"budget {bad!r} accepted")


def check_module_on_gpu():
    """Documented: a module already on the GPU is copied to host memory first."""
    model = llama(False, seed=3)
    ref = copy.deepcopy(model).to(DEV)
    model = model.to(DEV)
    before = allocated()
    handle = offload(model, int(model_bytes(model) * 0.4))
    report = handle.report()
    if not HOST_DOUBLE:
        assert report["moved_from_device_bytes"] > 0, report
        assert allocated() < before - report["moved_from_device_bytes"] // 2, (allocated(), before)
    ids, mask, new = prompts()[0]
    with torch.no_grad():
        assert torch.equal(generate(model, ids, mask, new), generate(ref, ids, mask, new))
    handle.remove()


def check_already_offloaded_refused():
    model = llama(False)
    handle = offload(model, int(model_bytes(model) * 0.5))
    try:
        offload(model, int(model_bytes(model) * 0.5))
    except ValueError as e:
        assert "already offloaded" in str(e), e
    else:
        raise AssertionError("a second offload of the same module was accepted")
    handle.remove()


class Chain(nn.Module):
    """Three layers whose call order is chosen per call: a change of call path."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.order = "abc"

    def forward(self, x):
        for name in self.order:
            x = torch.relu(getattr(self, name)(x))
        return x


def chain_pair(order):
    torch.manual_seed(7)
    net = Chain().eval()
    net.order = order
    ref = copy.deepcopy(net).to(DEV)
    piece = 64 * 64 * 4 + 256  # weight + bias, each aligned to 256
    # Two slots (depth 1) and nothing resident: every piece streams.
    handle = offload(net, 2 * piece, prefetch_depth=1, small_bytes=0)
    assert handle.report()["resident_pieces"] == 0, handle.report()
    return net, ref, handle


def check_order_change_relearned():
    net, ref, handle = chain_pair("abc")
    x = torch.randn(5, 64).to(DEV)
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))
        assert handle.stats()["out_of_order"] == 0
        net.order = ref.order = "cba"  # another call path: demand-paged, counted, correct
        assert torch.equal(net(x), ref(x))
        s = handle.stats()
        assert s["out_of_order"] > 0 and s["order_changes"] == 1 and s["relearns"] == 0, s
        assert torch.equal(net(x), ref(x))  # the same new order twice: relearned
        s = handle.stats()
        assert s["relearns"] == 1, s
        ooo = s["out_of_order"]
        assert torch.equal(net(x), ref(x))
        assert handle.stats()["out_of_order"] == ooo, handle.stats()
        net.order = ref.order = "abc"
        for _ in range(3):
            assert torch.equal(net(x), ref(x))
    handle.remove()


def check_first_forward_learns():
    net, ref, handle = chain_pair("bca")  # not the registration order
    x = torch.randn(3, 64).to(DEV)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(net(x), ref(x))
    s = handle.stats()
    assert s["relearns"] == 1, s  # learned from the first forward
    handle.remove()


def check_submodule_called_directly():
    """A unit called outside the top-level forward: paged on demand, counted, correct."""
    net, ref, handle = chain_pair("abc")
    x = torch.randn(4, 64).to(DEV)
    with torch.no_grad():
        net(x)
        before = handle.stats()["out_of_order"]
        assert torch.equal(net.c(x), ref.c(x))
        assert torch.equal(net.a(x), ref.a(x))
        assert handle.stats()["out_of_order"] > before
        assert torch.equal(net(x), ref(x))
    handle.remove()


def check_grad_input_refused():
    net, ref, handle = chain_pair("abc")
    x = torch.randn(2, 64, device=DEV, requires_grad=True)
    try:
        net(x)
    except RuntimeError as e:
        assert "inference" in str(e), e
    else:
        raise AssertionError("an input requiring grad was accepted")
    with torch.no_grad():  # still usable
        y = torch.randn(2, 64).to(DEV)
        assert torch.equal(net(y), ref(y))
    handle.remove()


def check_remove_restores_host_parameters():
    net, ref, handle = chain_pair("abc")
    x = torch.randn(2, 64).to(DEV)
    with torch.no_grad():
        net(x)
    handle.remove()
    assert getattr(net, "_vram_offload", None) is None
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert p.device.type == "cpu", name
        assert torch.equal(p, q.cpu()), name


CHECKS = [name for name in list(globals()) if name.startswith("check_")
          and name not in ("check_generate",)]


def main():
    failed = 0
    for name in CHECKS:
        try:
            globals()[name]()
            print(f"PASS {name}", flush=True)
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{len(CHECKS) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
