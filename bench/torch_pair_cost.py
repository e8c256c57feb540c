"""Micro-benchmark: the cost of one tensor allocate/free pair through PyTorch
(torch.empty on the GPU, then dropping it), per allocator, each in its own interpreter:

    python3 bench/torch_pair_cost.py OUT.json --lib NAME=PATH [--lib NAME=PATH ...]

Allocators: PyTorch's caching allocator (`torch`), the same with expandable segments
(`torch-expandable`), and each --lib (a libvram_torch.so, made PyTorch's allocator with
vram_torch.enable(): the native allocator of a build with Torch, the pluggable route of one
without). Sizes 512 B, 64 KiB, 4 MiB, 64 MiB, each freed before the next is taken (the warm
path every allocator serves from its cache). Per size: 7 rounds of 20,000 pairs after a
warm-up, wall time per pair (time.perf_counter; no kernel runs, so no synchronize is
needed), median and p10..p90 over the rounds. A micro-benchmark: it measures the allocator
call through PyTorch, not a workload.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = [512, 64 << 10, 4 << 20, 64 << 20]
ROUNDS, PAIRS = 7, 20000

CHILD = r"""
import json, os, sys, time
kind, lib = sys.argv[1], sys.argv[2]
import torch
if lib:
    sys.path.insert(0, os.path.join(sys.argv[3], "python"))
    import vram_torch
    mode = vram_torch.enable(lib)
else:
    mode = torch.cuda.memory.get_allocator_backend()
torch.cuda.init()
out = {"kind": kind, "mode": mode, "sizes": {}}
for size in [int(s) for s in sys.argv[4].split(",")]:
    for _ in range(2000):
        t = torch.empty(size, dtype=torch.uint8, device="cuda"); del t
    rounds = []
    for _ in range(int(sys.argv[5])):
        n = int(sys.argv[6])
        start = time.perf_counter()
        for _ in range(n):
            t = torch.empty(size, dtype=torch.uint8, device="cuda"); del t
        rounds.append((time.perf_counter() - start) / n * 1e9)
    out["sizes"][str(size)] = rounds
print("RESULT " + json.dumps(out), flush=True)
"""


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--lib", action="append", default=[], metavar="NAME=PATH")
    args = p.parse_args()
    runs = [("torch", "", {}), ("torch-expandable", "",
                                {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})]
    for item in args.lib:
        name, _, path = item.partition("=")
        runs.append((name, os.path.abspath(path), {}))
    results = {}
    for name, lib, env in runs:
        full_env = dict(os.environ, **env)
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, name, lib, ROOT, ",".join(map(str, SIZES)),
             str(ROUNDS), str(PAIRS)], capture_output=True, text=True, env=full_env,
            timeout=600)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not rows:
            print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}")
            results[name] = {"error": proc.stderr[-2000:]}
            continue
        results[name] = json.loads(rows[-1][len("RESULT "):])
    lines = ["| allocator (mode) | " + " | ".join(
        f"{s} B ns/pair median (p10..p90)" for s in SIZES) + " |",
             "|---|" + "---|" * len(SIZES)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed |")
            continue
        cells = []
        for s in SIZES:
            v = r["sizes"][str(s)]
            cells.append(f"{statistics.median(v):.0f} ({pct(v, 0.1):.0f}..{pct(v, 0.9):.0f})")
        lines.append(f"| {name} ({r['mode']}) | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        json.dump({"rounds": ROUNDS, "pairs": PAIRS, "results": results, "table": text}, f,
                  indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
