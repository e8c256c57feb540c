"""Real models over each allocator: peak reserved memory and step time, each run in its own
interpreter (the allocator is chosen before CUDA starts):

    python3 bench/torch_models.py OUT.json [--lib NAME=PATH[,PYTHON_DIR] ...] [--rounds 2]

Models, built from transformers configs with random weights (nothing downloaded): Llama
(training with AdamW, then generation with a growing KV cache), Mixtral (training, 8
experts, top-2 routing: sizes change with the routing) and ViT (training). bf16 weights,
fixed seeds, so every allocator runs the same shapes. Allocators: PyTorch's caching
allocator (`torch`), with expandable segments (`torch-expandable`), and each --lib (a
libvram_torch.so made PyTorch's allocator with vram_torch.enable()). Per run: the median
of the timed steps (each step ends with a synchronize; the first steps are warm-up) and
torch.cuda.memory_stats()['reserved_bytes.all.peak'] over the whole run. Rounds alternate
the allocators' order; reported: the median over rounds of the per-run median step and
the range over rounds, and the largest peak reserved.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, os, statistics, sys, time
model_name, lib, pydir = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
if lib:
    sys.path.insert(0, pydir)
    import vram_torch
    vram_torch.enable(lib)
import transformers
torch.manual_seed(0)
dev = "cuda"

def timed(step, steps, warmup):
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step(i)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out

def train(model, batch):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    def step(i):
        loss = model(**batch(i)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
    times, _ = timed(step, 10, 3)
    return times, losses

if model_name in ("llama", "llama_generate"):
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=8, num_attention_heads=16,
                                   num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=4096)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
elif model_name == "mixtral":
    cfg = transformers.MixtralConfig(hidden_size=1024, intermediate_size=3584,
                                     num_hidden_layers=6, num_attention_heads=16,
                                     num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000)
    with torch.device(dev):
        model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
else:
    cfg = transformers.ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, image_size=224, patch_size=16,
                                 num_labels=1000)
    with torch.device(dev):
        model = transformers.ViTForImageClassification(cfg).to(torch.bfloat16)

gen = torch.Generator(device=dev).manual_seed(1)
if model_name in ("llama", "mixtral"):
    def batch(i):
        seq = [1024, 768, 1536, 512, 1024, 2048, 768, 1280, 1024, 896][i]
        ids = torch.randint(0, 32000, (4, seq), device=dev, generator=gen)
        return {"input_ids": ids, "labels": ids}
    times, values = train(model, batch)
elif model_name == "vit":
    def batch(i):
        return {"pixel_values": torch.randn(64, 3, 224, 224, device=dev, dtype=torch.bfloat16,
                                            generator=gen),
                "labels": torch.randint(0, 1000, (64,), device=dev, generator=gen)}
    times, values = train(model, batch)
else:
    model.eval()
    values = []
    def step(i):
        prompt = torch.randint(0, 32000, (8, 128 + 64 * (i % 4)), device=dev, generator=gen)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=96, min_new_tokens=96, do_sample=False,
                                 pad_token_id=0)
        values.append(int(out.sum().item()))
    times, _ = timed(step, 8, 2)
if lib and getattr(vram_torch, "mode", lambda: "pluggable")() != "native":
    # the pluggable route (and builds before the native one) has no torch.cuda stats
    stats = vram_torch.stats()
else:
    stats = torch.cuda.memory_stats()
print("RESULT " + json.dumps({"median_ms": statistics.median(times),
                              "times_ms": times, "values": values,
                              "peak_reserved": stats["reserved_bytes.all.peak"],
                              "peak_allocated": stats["allocated_bytes.all.peak"]}), flush=True)
"""

MODELS = ["llama", "llama_generate", "mixtral", "vit"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--lib", action="append", default=[], metavar="NAME=PATH[,PYTHON_DIR]",
                   help="a libvram_torch.so; PYTHON_DIR: the vram_torch package of its build "
                   "(default: this tree's python/)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--no-expandable", action="store_true")
    args = p.parse_args()
    allocators = [("torch", "", {}, "")]
    if not args.no_expandable:
        allocators.append(("torch-expandable", "",
                           {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, ""))
    for item in args.lib:
        name, _, rest = item.partition("=")
        path, _, pydir = rest.partition(",")
        allocators.append((name, os.path.abspath(path), {},
                           os.path.abspath(pydir) if pydir else os.path.join(ROOT, "python")))
    runs = {}
    for r in range(args.rounds):
        for m in args.models.split(","):
            order = allocators if r % 2 == 0 else list(reversed(allocators))
            for name, lib, env, pydir in order:
                proc = subprocess.run([sys.executable, "-c", CHILD, m, lib, pydir],
                                      capture_output=True, text=True, timeout=600,
                                      env=dict(os.environ, **env))
                rows = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                key = f"{m}/{name}"
                if proc.returncode != 0 or not rows:
                    runs.setdefault(key, []).append({"error": proc.stderr[-1500:]})
                    print(f"{key} round {r}: failed\n{proc.stderr[-1500:]}", flush=True)
                    continue
                row = json.loads(rows[-1][len("RESULT "):])
                runs.setdefault(key, []).append(row)
                print(f"{key} round {r}: {row['median_ms']:.1f} ms, peak reserved "
                      f"{row['peak_reserved'] / 2**30:.2f} GiB", flush=True)
                with open(args.out, "w") as f:  # what ran so far, should a limit cut the run
                    json.dump({"rounds": args.rounds, "runs": runs}, f, indent=1)
    lines = ["| model | allocator | step ms median over rounds (range) | peak reserved GiB "
             "(max over rounds) | results equal PyTorch's |", "|---|---|---|---|---|"]
    for m in args.models.split(","):
        reference = [r.get("values") for r in runs.get(f"{m}/torch", [])]
        for name, _, _, _ in allocators:
            rows = [r for r in runs.get(f"{m}/{name}", []) if "error" not in r]
            if not rows:
                lines.append(f"| {m} | {name} | failed | | |")
                continue
            med = [r["median_ms"] for r in rows]
            same = all(r["values"] == reference[0] for r in rows) if reference else None
            lines.append(f"| {m} | {name} | {statistics.median(med):.1f} ({min(med):.1f}.."
                         f"{max(med):.1f}) | {max(r['peak_reserved'] for r in rows) / 2**30:.2f}"
                         f" | {same} |")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        json.dump({"rounds": args.rounds, "runs": runs, "table": text}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
