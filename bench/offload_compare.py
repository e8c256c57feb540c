"""vram_torch.offload against all-resident and Hugging Face accelerate's offload, on models
built from configs (no downloads): greedy decoding (batch 1) and the prefill of a long prompt.

    python3 bench/offload_compare.py OUT_DIR [--models llama,mixtral] [--budget-gib 2]
        [--rows vram_leaf,vram_pageable,all_resident,accelerate]

--models (or --arch) picks the models, --rows the rows (default: every row; all_resident
always runs: its tokens are the reference). A short GPU run: --models mixtral --rows
vram_leaf,vram_pageable,vram_everything_resident --no-accelerate.

Per model, in one process and one run: the pinned host-to-device rate (the link bound's
rate), all-resident, vram offload (leaf pieces, whole-unit pieces, pageable host weights),
accelerate (infer_auto_device_map(max_memory={0: budget, "cpu": ...}) + dispatch_model).
ms/token = (time of generate(N2 tokens) - time of generate(N1 tokens)) / (N2 - N1);
the link bound = bytes the plan streams per forward / pinned rate (and, ideal, the model's
bytes beyond the budget / pinned rate). Peak device memory of an offloaded run = the pager's
arena + PyTorch's peak allocated during the run. Writes OUT_DIR/offload_compare.json and
.md; prints the table. --tiny --host-double: a smoke run on the CPU (no GPU).
"""
import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
ROWS = ("all_resident", "vram_leaf", "vram_param", "vram_leaf_depth1", "vram_leaf_depth1_third",
        "vram_unit", "vram_pageable", "vram_leaf_single", "vram_everything_resident",
        "accelerate")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pinned_rate(dev, nbytes=1 << 30, reps=5):
    """H2D GB/s from a pinned buffer (cudaMemcpyAsync through torch)."""
    if dev.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return nbytes / best / 1e9


def build(arch, tiny, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    if arch == "llama":
        if tiny:
            cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
        else:  # 5.77 GiB in bf16
            cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                              max_position_embeddings=32768)
        cls = LlamaForCausalLM
    elif arch == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        if tiny:
            cfg = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                num_local_experts=4, num_experts_per_tok=2)
        else:
            cfg = MixtralConfig(hidden_size=2048, intermediate_size=1792, num_hidden_layers=16,
                                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                num_local_experts=8, num_experts_per_tok=2,
                                max_position_embeddings=32768)
        cls = MixtralForCausalLM
    else:
        raise ValueError(arch)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def gen(model, ids, n):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False)


def decode_ms(model, ids, dev, n1, n2, reps=1):
    """ms per generated token (difference of two generate lengths) and the tokens of n2."""
    best = float("inf")
    out = None
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        gen(model, ids, n1)
        sync(dev)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        out = gen(model, ids, n2)
        sync(dev)
        t2 = time.perf_counter() - t
        best = min(best, (t2 - t1) / (n2 - n1) * 1e3)
    return best, out


def prefill_ms(model, ids, dev, reps):
    times = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        gen(model, ids, 1)
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)


def param_bytes(model):
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def run_arch(arch, args, dev, rate, log):
    import vram_torch

    res = {"arch": arch}
    torch.manual_seed(0)
    model = build(arch, args.tiny, dev)
    model_bytes = param_bytes(model)
    budget = int(args.budget_gib * GiB) if not args.tiny else model_bytes // 2
    if arch == "mixtral" and not args.tiny:
        budget = int(args.moe_budget_gib * GiB)
    res.update(model_bytes=model_bytes, budget_bytes=budget, ratio=model_bytes / budget)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (1, args.prompt), generator=g).to(dev)
    long_prompt = torch.randint(1, vocab, (1, args.long_prompt), generator=g).to(dev)
    n1, n2 = args.n1, args.n2
    log(f"[{arch}] model {model_bytes / GiB:.2f} GiB, budget {budget / GiB:.2f} GiB "
        f"({model_bytes / budget:.2f}x)")

    # All resident.
    gen(model, prompt, 2)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
    ms, ref_tokens = decode_ms(model, prompt, dev, n1, n2, reps=2)
    res["resident_ms_per_token"] = ms
    gen(model, long_prompt, 1)
    res["resident_prefill_ms"] = prefill_ms(model, long_prompt, dev, args.prefill_reps)
    if dev.type == "cuda":
        res["resident_activation_peak"] = torch.cuda.max_memory_allocated(dev) - weights
    log(f"[{arch}] resident: {ms:.2f} ms/token, prefill {args.long_prompt}: "
        f"{res['resident_prefill_ms']:.1f} ms, activations peak "
        f"{res.get('resident_activation_peak', 0) / GiB:.2f} GiB")
    if dev.type == "cuda":
        model.cpu()
        torch.cuda.empty_cache()
        gc.collect()

    def offloaded(label, n_a, n_b, prefill, budget_bytes=None, **kw):
        entry = {"budget_bytes": budget_bytes or budget}
        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            t = time.perf_counter()
            handle = vram_torch.offload(model, entry["budget_bytes"], device=0,
                                        host_double=dev.type == "cpu",
                                        verbose=False, small_bytes=args.small_bytes, **kw)
            entry["offload_seconds"] = time.perf_counter() - t
            entry["report"] = {k: v for k, v in handle.report().items() if k != "piece_names"}
            gen(model, prompt, 2)  # learns the schedule
            handle.reset_stats()
            ms, tokens = decode_ms(model, prompt, dev, n_a, n_b)
            entry["ms_per_token"] = ms
            entry["tokens_identical"] = bool(torch.equal(tokens.cpu(),
                                                         ref_tokens[:, :tokens.shape[1]].cpu()))
            entry["stats"] = handle.stats()
            if prefill:
                gen(model, long_prompt, 1)
                entry["prefill_ms"] = prefill_ms(model, long_prompt, dev, args.prefill_reps)
            if dev.type == "cuda":
                entry["torch_peak_allocated"] = torch.cuda.max_memory_allocated(dev) - base
                entry["peak_device_bytes"] = (entry["torch_peak_allocated"]
                                              + entry["report"]["arena_bytes"])
            handle.remove()
            del handle
            gc.collect()
            log(f"[{arch}] {label}: {ms:.2f} ms/token, identical {entry['tokens_identical']}, "
                f"prefill {entry.get('prefill_ms', float('nan')):.1f} ms, streams "
                f"{entry['report']['streamed_bytes_per_forward'] / GiB:.3f} GiB/forward, ring "
                f"{entry['report']['ring_slots']} x {entry['report']['slot_bytes'] / MiB:.1f} MiB, "
                f"gbps {entry['stats'].get('effective_gbps', 0):.1f}, stalls "
                f"{entry['stats'].get('stalled')}/{entry['stats'].get('stall_samples')}, "
                f"out_of_order {entry['stats'].get('out_of_order')}")
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"[{arch}] {label}: FAILED {entry['error']}")
            traceback.print_exc()
            h = getattr(model, "_vram_offload", None)
            if h is not None:
                try:
                    h.remove()
                except Exception:  # noqa: BLE001
                    pass
        return entry

    short = max(n1 + 4, n2 // 2)
    rows = args.row_set
    if "vram_leaf" in rows:
        res["vram_leaf"] = offloaded("vram leaf", n1, n2, True, granularity="leaf",
                                     prefetch_depth=args.depth)
    if "vram_param" in rows:
        res["vram_param"] = offloaded("vram param", n1, n2, False, granularity="param",
                                      prefetch_depth=args.depth)
    if "vram_leaf_depth1" in rows:
        res["vram_leaf_depth1"] = offloaded("vram leaf depth 1", n1, n2, True,
                                            granularity="leaf", prefetch_depth=1)
    third = model_bytes // 3
    if "vram_leaf_depth1_third" in rows:
        res["vram_leaf_depth1_third"] = offloaded("vram leaf depth 1, budget = model / 3", n1,
                                                  short, False, budget_bytes=third,
                                                  granularity="leaf", prefetch_depth=1)
    if "vram_unit" in rows:
        res["vram_unit"] = offloaded("vram unit", n1, short, False, granularity="unit",
                                     prefetch_depth=1)
    if "vram_pageable" in rows:
        res["vram_pageable"] = offloaded("vram pageable", n1, short, False, granularity="leaf",
                                         host="pageable", prefetch_depth=args.depth)
    if "vram_leaf_single" in rows:  # leaf pieces not joined (the layout before coalescing)
        res["vram_leaf_single"] = offloaded("vram leaf, pieces not joined", n1, n2, False,
                                            granularity="leaf", prefetch_depth=args.depth,
                                            coalesce=False)
    # Hooks and views only: a budget that holds everything (nothing streams).
    if "vram_everything_resident" in rows:
        res["vram_everything_resident"] = offloaded(
            "vram, budget holds all", n1, short, False,
            budget_bytes=int(model_bytes * 1.05) + (64 << 20), granularity="leaf")
    for key in ("vram_leaf", "vram_leaf_depth1", "vram_param", "vram_leaf_depth1_third",
                "vram_unit", "vram_pageable", "vram_leaf_single"):
        streamed = res.get(key, {}).get("report", {}).get("streamed_bytes_per_forward")
        if streamed and rate:
            res[key]["link_bound_ms"] = streamed / (rate * 1e9) * 1e3

    if rate:
        res["ideal_link_bound_ms"] = max(model_bytes - budget, 0) / (rate * 1e9) * 1e3

    # accelerate at the same budget.
    if "accelerate" in rows and not args.no_accelerate and dev.type == "cuda":
        entry = {}
        try:
            from accelerate import dispatch_model, infer_auto_device_map
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            acc = build(arch, args.tiny, dev).cpu()  # the same weights, as plain CPU tensors
            model = acc
            torch.cuda.empty_cache()
            layer_cls = type(acc.model.layers[0]).__name__
            device_map = infer_auto_device_map(
                acc, max_memory={0: budget, "cpu": 200 * GiB}, no_split_module_classes=[layer_cls])
            entry["gpu_modules"] = sum(1 for v in device_map.values() if v == 0)
            entry["cpu_modules"] = sum(1 for v in device_map.values() if v == "cpu")
            torch.cuda.reset_peak_memory_stats(dev)
            acc = dispatch_model(acc, device_map=device_map, main_device=0)
            gen(acc, prompt, 1)
            ms, tokens = decode_ms(acc, prompt, dev, 1, 1 + args.acc_tokens)
            entry["ms_per_token"] = ms
            entry["tokens_identical"] = bool(torch.equal(tokens.cpu(),
                                                         ref_tokens[:, :tokens.shape[1]].cpu()))
            entry["prefill_ms"] = prefill_ms(acc, long_prompt, dev, 1)
            entry["torch_peak_allocated"] = torch.cuda.max_memory_allocated(dev)
            log(f"[{arch}] accelerate: {ms:.2f} ms/token, identical {entry['tokens_identical']}, "
                f"prefill {entry['prefill_ms']:.1f} ms")
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"[{arch}] accelerate: FAILED {entry['error']}")
            traceback.print_exc()
        res["accelerate"] = entry
    model = None
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def table(results, rate):
    lines = [f"pinned H2D rate measured in the run: {rate:.2f} GB/s", "",
             "| model | config | ms/token (decode, batch 1) | prefill ms | vs bound | tokens | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        name = f"{r['arch']} {r['model_bytes'] / GiB:.2f} GiB, budget {r['budget_bytes'] / GiB:.2f} GiB"
        lines.append(f"| {name} | all resident | {r['resident_ms_per_token']:.2f} | "
                     f"{r['resident_prefill_ms']:.1f} | | ref | |")
        for key in ("vram_leaf", "vram_leaf_depth1", "vram_param", "vram_leaf_depth1_third",
                    "vram_unit", "vram_pageable", "vram_leaf_single", "vram_everything_resident",
                    "accelerate"):
            e = r.get(key)
            if not e:
                continue
            if "error" in e:
                lines.append(f"| {name} | {key} | failed | | | | {e['error'][:160]} |")
                continue
            bound = e.get("link_bound_ms")
            target = max(r["resident_ms_per_token"], bound) if bound else None
            if key in ("vram_everything_resident", "accelerate"):
                target = r["resident_ms_per_token"]
            vs = f"{e['ms_per_token'] / target:.3f}x" if target else ""
            pre = e.get("prefill_ms")
            pre_s = f"{pre:.1f} ({pre / r['resident_prefill_ms']:.3f}x)" if pre else ""
            rep = e.get("report", {})
            st = e.get("stats", {})
            notes = []
            if rep:
                notes.append(f"streams {rep['streamed_bytes_per_forward'] / GiB:.3f} GiB, ring "
                             f"{rep['ring_slots']}x{rep['slot_bytes'] / MiB:.0f} MiB, "
                             f"pinned {rep['pinned']}")
            if st.get("effective_gbps"):
                notes.append(f"{st['effective_gbps']:.1f} GB/s copies, stalls "
                             f"{st['stalled']}/{st['stall_samples']}")
            if e.get("peak_device_bytes"):
                limit = r["budget_bytes"] + r.get("resident_activation_peak", 0)
                notes.append(f"peak device {e['peak_device_bytes'] / GiB:.2f} GiB (budget + "
                             f"resident activations {limit / GiB:.2f})")
            if key == "accelerate" and r.get("vram_leaf", {}).get("ms_per_token"):
                notes.append(f"vram leaf is {e['ms_per_token'] / r['vram_leaf']['ms_per_token']:.1f}x faster")
            label = key
            if e.get("budget_bytes") and e["budget_bytes"] != r["budget_bytes"]:
                label += f" (budget {e['budget_bytes'] / GiB:.2f} GiB)"
            lines.append(f"| {name} | {label} | {e['ms_per_token']:.2f} | {pre_s} | {vs} | "
                         f"{'identical' if e.get('tokens_identical') else 'DIFFER'} | "
                         f"{'; '.join(notes)} |")
        if r.get("ideal_link_bound_ms"):
            lines.append(f"| {name} | link bound | plan (leaf): "
                         f"{r.get('vram_leaf', {}).get('link_bound_ms', float('nan')):.2f}; ideal "
                         f"(model - budget): {r['ideal_link_bound_ms']:.2f} | | | | |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", "--models", dest="arch", default="llama,mixtral",
                    help="models, comma-separated: llama, mixtral")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="rows, comma-separated, of: " + ", ".join(ROWS)
                    + " (all_resident always runs: the reference tokens)")
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--moe-budget-gib", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=16384)
    ap.add_argument("--n1", type=int, default=4)
    ap.add_argument("--n2", type=int, default=28)
    ap.add_argument("--acc-tokens", type=int, default=3)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--small-bytes", type=int, default=1 << 20)
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--host-double", action="store_true")
    args = ap.parse_args()
    args.row_set = {r.strip() for r in args.rows.split(",") if r.strip()}
    unknown = args.row_set - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; rows: {', '.join(ROWS)}")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cpu") if args.host_double else torch.device("cuda", 0)
    if args.tiny:
        args.long_prompt = min(args.long_prompt, 64)
        args.small_bytes = 4096

    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    rate = pinned_rate(dev)
    log(f"pinned H2D: {rate:.2f} GB/s")
    env = {"torch": torch.__version__}
    try:
        import transformers
        env["transformers"] = transformers.__version__
        import accelerate
        env["accelerate"] = accelerate.__version__
    except Exception:  # noqa: BLE001
        pass
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    results = []
    for arch in args.arch.split(","):
        try:
            results.append(run_arch(arch, args, dev, rate, log))
        except Exception as e:  # noqa: BLE001
            log(f"[{arch}] FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
    rate_end = pinned_rate(dev)
    log(f"pinned H2D at the end: {rate_end:.2f} GB/s")
    args.row_set = sorted(args.row_set)
    out = {"env": env, "args": vars(args), "seconds": time.perf_counter() - start,
           "pinned_gbps": rate, "pinned_gbps_end": rate_end,
           "results": results}
    with open(os.path.join(args.out, "offload_compare.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    md = table(results, rate) if results else "no results"
    with open(os.path.join(args.out, "offload_compare.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
