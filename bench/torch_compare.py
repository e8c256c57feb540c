"""PyTorch's default CUDA allocator against vram (libvram_torch.so) on the real workloads of
tools/torch/workloads.py: identical per-step results, step time, peak reserved memory.

    python3 bench/torch_compare.py OUT_DIR [--lib build/plugins/torch/libvram_torch.so]

Each (workload, allocator) runs in a fresh interpreter (the allocator must be chosen before
CUDA starts), the allocators alternating per workload. Timing: the workload functions are
not changed; the harness wraps their random.Random so that every rng.choice() call (each
step draws its shapes first) synchronises the device and takes a time stamp. With k draws
per step, step i starts at stamp i*k; the last step ends when run() returns (after a
synchronize). The first --warmup steps are excluded. Figures per workload:
  identical        the per-step floats (losses / checksums) compare exactly equal
  median step ms   median over the timed steps, per allocator
  step ratio       median over timed steps of vram_step_i / torch_step_i (paired: both
                   runs draw the same shapes in the same order), the target is <= 1.01
  peak reserved    torch.cuda.memory_stats()['reserved_bytes.all.peak'] for PyTorch,
                   vram_torch.stats()['reserved_bytes.all.peak'] for vram (whole run, the
                   model and optimizer state included); target vram <= PyTorch
Writes OUT_DIR/torch_compare.json and OUT_DIR/torch_compare.md. Exit status: 0 when every
workload ran and its results are identical, 1 when some result differs, 2 when a run failed.
Time and memory targets are reported, not turned into the exit status.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_STEPS = {"transformer_training": 24, "decode_growing_caches": 8, "conv_training": 24}
DEFAULT_WARMUP = {"transformer_training": 4, "decode_growing_caches": 2, "conv_training": 4}


# --- child: one workload with one allocator --------------------------------------------
def _timed_random_module(stamps, sync):
    """A stand-in for the `random` module inside workloads.py whose Random records a
    synchronized time stamp at every choice()."""
    import random
    import types

    class TimedRandom(random.Random):
        def choice(self, seq):
            sync()
            stamps.append(time.perf_counter())
            return super().choice(seq)

    shim = types.ModuleType("random")
    shim.__dict__.update({k: getattr(random, k) for k in dir(random) if not k.startswith("__")})
    shim.Random = TimedRandom
    return shim


def child(name, allocator, steps, warmup, result_path, lib):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "tools", "torch"))
    import torch

    if allocator == "vram":
        import vram_torch

        vram_torch.enable(lib)
    import workloads

    stamps = []
    workloads.random = _timed_random_module(stamps, torch.cuda.synchronize)
    start = time.perf_counter()
    values = workloads.run(name, steps, "cuda")
    torch.cuda.synchronize()
    end = time.perf_counter()
    if len(stamps) % steps != 0 or not stamps:
        raise RuntimeError(f"{len(stamps)} rng.choice calls for {steps} steps: cannot find "
                           "step boundaries (workloads.py changed?)")
    per_step = len(stamps) // steps
    starts = stamps[::per_step] + [end]
    step_s = [b - a for a, b in zip(starts, starts[1:])]
    if allocator == "vram":
        s = vram_torch.stats()
        peak_reserved, peak_allocated = s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
        extra = {"num_device_alloc": s["num_device_alloc"], "num_ooms": s["num_ooms"],
                 "num_alloc_retries": s["num_alloc_retries"]}
    else:
        s = torch.cuda.memory_stats()
        peak_reserved, peak_allocated = s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
        extra = {"num_device_alloc": s.get("num_device_alloc", -1), "num_ooms": s["num_ooms"],
                 "num_alloc_retries": s["num_alloc_retries"]}
    with open(result_path, "w") as out:
        json.dump({"workload": name, "allocator": allocator, "steps": steps, "warmup": warmup,
                   "values": values, "step_s": step_s, "total_s": end - start,
                   "peak_reserved": peak_reserved, "peak_allocated": peak_allocated,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   **extra}, out)


# --- parent ------------------------------------------------------------------------------
def run_child(args, name, allocator, steps, warmup, out_dir):
    result_path = os.path.join(out_dir, f"torch_compare_{name}_{allocator}.json")
    log_path = os.path.join(out_dir, f"torch_compare_{name}_{allocator}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, allocator, str(steps),
           str(warmup), result_path]
    if args.lib:
        cmd += ["--lib", args.lib]
    if os.path.exists(result_path):
        os.remove(result_path)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(result_path):
        return None, f"{allocator} run failed (rc {proc.returncode}), see {log_path}"
    with open(result_path) as f:
        return json.load(f), ""


def compare(torch_run, vram_run, warmup):
    t = torch_run["step_s"][warmup:]
    v = vram_run["step_s"][warmup:]
    ratios = [b / a for a, b in zip(t, v) if a > 0]
    identical = torch_run["values"] == vram_run["values"]
    first_diff = next((i for i, (a, b) in enumerate(zip(torch_run["values"], vram_run["values"]))
                       if a != b), None)
    row = {
        "identical": identical,
        "first_differing_step": first_diff,
        "timed_steps": len(t),
        "torch_median_step_ms": statistics.median(t) * 1e3,
        "vram_median_step_ms": statistics.median(v) * 1e3,
        "step_ratio_median": statistics.median(ratios),
        "torch_peak_reserved": torch_run["peak_reserved"],
        "vram_peak_reserved": vram_run["peak_reserved"],
        "torch_peak_allocated": torch_run["peak_allocated"],
        "vram_peak_allocated": vram_run["peak_allocated"],
    }
    row["time_target_met"] = row["step_ratio_median"] <= 1.01
    row["memory_target_met"] = row["vram_peak_reserved"] <= row["torch_peak_reserved"]
    return row


def markdown(rows, meta):
    mib = 1 << 20
    lines = [
        f"PyTorch {meta.get('torch', '?')} on {meta.get('device', '?')}; steps timed after "
        "warm-up; step ratio = median over steps of vram/PyTorch (target <= 1.01); peak "
        "reserved over the whole run (target vram <= PyTorch).",
        "",
        "| workload | identical results | timed steps | PyTorch median step (ms) | vram median "
        "step (ms) | step ratio | PyTorch peak reserved (MiB) | vram peak reserved (MiB) | "
        "targets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | run failed: {row['error']} | | | | | | | |")
            continue
        met = [("results" if row["identical"] else "RESULTS DIFFER"),
               ("time" if row["time_target_met"] else "time MISSED"),
               ("memory" if row["memory_target_met"] else "memory MISSED")]
        lines.append(
            f"| {name} | {'yes' if row['identical'] else 'NO (step %s)' % row['first_differing_step']}"
            f" | {row['timed_steps']} | {row['torch_median_step_ms']:.2f} | "
            f"{row['vram_median_step_ms']:.2f} | {row['step_ratio_median']:.4f} | "
            f"{row['torch_peak_reserved'] / mib:.0f} | {row['vram_peak_reserved'] / mib:.0f} | "
            f"{', '.join(met)} |")
    return "\n".join(lines) + "\n"


def parse_counts(text, defaults):
    counts = dict(defaults)
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in counts:
            raise SystemExit(f"unknown workload {name!r} in {text!r}")
        counts[name] = int(value)
    return counts


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        p = argparse.ArgumentParser()
        p.add_argument("--child", nargs=5, metavar=("NAME", "ALLOC", "STEPS", "WARMUP", "OUT"))
        p.add_argument("--lib", default=None)
        a = p.parse_args()
        name, alloc, steps, warmup, out = a.child
        child(name, alloc, int(steps), int(warmup), out, a.lib)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--lib", default=os.environ.get("VRAM_TORCH_LIB"),
                   help="libvram_torch.so (default: $VRAM_TORCH_LIB or a build*/ folder)")
    p.add_argument("--workloads", default=",".join(DEFAULT_STEPS))
    p.add_argument("--steps", default="", help="e.g. conv_training=40,decode_growing_caches=6")
    p.add_argument("--warmup", default="", help="same form as --steps")
    p.add_argument("--timeout", type=int, default=300, help="seconds per child run")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    steps = parse_counts(args.steps, DEFAULT_STEPS)
    warmup = parse_counts(args.warmup, DEFAULT_WARMUP)
    rows, meta, status = {}, {}, 0
    for i, name in enumerate(filter(None, args.workloads.split(","))):
        if name not in DEFAULT_STEPS:
            raise SystemExit(f"unknown workload {name!r}")
        if warmup[name] >= steps[name]:
            raise SystemExit(f"{name}: warm-up {warmup[name]} >= steps {steps[name]}")
        order = ["torch", "vram"] if i % 2 == 0 else ["vram", "torch"]
        runs, errors = {}, []
        for alloc in order:
            started = time.time()
            run, error = run_child(args, name, alloc, steps[name], warmup[name], args.out_dir)
            print(f"{name} / {alloc}: {'ok' if run else error} ({time.time() - started:.1f} s)",
                  flush=True)
            if run:
                runs[alloc] = run
                meta = {"torch": run["torch"], "device": run["device"]}
            else:
                errors.append(error)
        if errors:
            rows[name] = {"error": "; ".join(errors)}
            status = 2
            continue
        rows[name] = compare(runs["torch"], runs["vram"], warmup[name])
        rows[name]["runs"] = {k: {f: v[f] for f in ("values", "step_s", "total_s",
                                                     "num_device_alloc", "num_ooms",
                                                     "num_alloc_retries")}
                              for k, v in runs.items()}
        if not rows[name]["identical"] and status == 0:
            status = 1
    table = markdown(rows, meta)
    with open(os.path.join(args.out_dir, "torch_compare.json"), "w") as f:
        json.dump({"meta": meta, "steps": steps, "warmup": warmup, "workloads": rows}, f,
                  indent=1)
    with open(os.path.join(args.out_dir, "torch_compare.md"), "w") as f:
        f.write(table)
    print(table)
    return status


if __name__ == "__main__":
    sys.exit(main())
