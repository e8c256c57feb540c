"""PyTorch's default CUDA allocator against vram (libvram_torch.so) on the real workloads of
tools/torch/workloads.py: identical per-step results, step time, peak reserved memory.

    python3 bench/torch_compare.py OUT_DIR [--lib build/plugins/torch/libvram_torch.so]
                                           [--rounds 4] [--steps ...] [--warmup ...]

Every run of a (workload, allocator) is a fresh interpreter (the allocator must be chosen
before CUDA starts). The runs go in --rounds rounds; each round runs every workload once
with each allocator, the two allocators back to back; who goes first alternates between
rounds and between workloads (round r, workload i: PyTorch first when r + i is even), so
a drift of the machine (clocks, temperature, other load) and any order effect hit both
allocators alike over an even number of rounds. --vram-env KEY=VALUE (repeatable) sets an
environment variable for the vram runs only (e.g. VRAM_TORCH_VIRTUAL_MEMORY=0). Every run of a workload uses the same
seed, so it draws the same shapes (for the decode workload: the same sequence of request
sizes and lengths) in the same order, in every round and with both allocators.

Epochs (--epochs, default 2): each run goes through its steps that many times in one
process, the workload built afresh each time with the same seed (the same shapes in the same
order); only the last epoch is timed, so every timed step has a shape seen before (kernels
loaded, library heuristics cached, each allocator holding what the workload needs): the
steady state a training or serving loop spends its time in. The first epoch's paired ratio is
reported too (notes, JSON first_epoch_step_ratio_rounds). --epochs 1 is the old single pass
with --warmup steps excluded. Results are compared over all epochs.

Timing: the workload functions are not changed; the harness wraps their random.Random so
that every rng.choice() call (each step draws its shapes first) synchronises the device and
takes a time stamp. With k draws per step, step i starts at stamp i*k; the last step ends
when run() returns (after a synchronize). The first --warmup steps of every run are
excluded (of the timed epoch; with several epochs none by default). Per round: median step of each allocator, and the paired ratio = median over the
timed steps of vram_step_i / torch_step_i. Figures per workload:
  identical        in every round the per-step floats (losses / checksums) of the two
                   allocators compare exactly equal (drives the exit status);
                   identical_across_rounds says whether every run of every round did
  median step ms   median over rounds of each allocator's per-round median step
  step ratio       median over rounds of the per-round paired ratio; the target is <= 1.01
  ratio spread     min .. max of the per-round paired ratios
  peak reserved    torch.cuda.memory_stats()['reserved_bytes.all.peak'] for PyTorch,
                   vram_torch.stats()['reserved_bytes.all.peak'] for vram (whole run, the
                   model and optimizer state included), the max over rounds; target vram
                   <= PyTorch
Writes OUT_DIR/torch_compare.json and OUT_DIR/torch_compare.md (per-run results and logs:
OUT_DIR/torch_compare_<workload>_<allocator>_r<round>.json/.log). Exit status: 0 when every
workload ran and its results are identical, 1 when some result differs, 2 when a run failed.
Time and memory targets are reported, not turned into the exit status.

Cost: each run pays the interpreter, import torch, CUDA start and model build (several
seconds) besides its steps, so the defaults are few steps per run and 4 rounds (even, so
each allocator goes first equally often): 4 x 2 x 3 = 24 runs; with 2 epochs, decode 8
requests per epoch (about 0.8 s each), 32 timed requests per allocator over the rounds.
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
DEFAULT_STEPS = {"transformer_training": 15, "decode_growing_caches": 12, "conv_training": 15}
DEFAULT_WARMUP = {"transformer_training": 3, "decode_growing_caches": 2, "conv_training": 3}
DEFAULT_ROUNDS = 4
DEFAULT_EPOCHS = 2
# Steps per epoch when several epochs run (decode's requests are long: 8 per epoch).
DEFAULT_EPOCH_STEPS = {"transformer_training": 15, "decode_growing_caches": 8, "conv_training": 15}
TIME_TARGET = 1.01
RUN_FIELDS = ("values", "step_s", "epoch_step_s", "total_s", "num_device_alloc", "num_ooms", "num_alloc_retries")


# --- child: one workload with one allocator --------------------------------------------
def _timed_random_module(stamps, sync, draws):
    """A stand-in for the `random` module inside workloads.py whose Random records a
    synchronized time stamp at every choice(), and the value drawn."""
    import random
    import types

    class TimedRandom(random.Random):
        def choice(self, seq):
            sync()
            stamps.append(time.perf_counter())
            value = super().choice(seq)
            draws.append(value)
            return value

    shim = types.ModuleType("random")
    shim.__dict__.update({k: getattr(random, k) for k in dir(random) if not k.startswith("__")})
    shim.Random = TimedRandom
    return shim


def child(name, allocator, steps, warmup, result_path, lib, epochs=1):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "tools", "torch"))
    import torch

    if allocator == "vram":
        import vram_torch

        vram_torch.enable(lib)
    import workloads

    # Each epoch runs the workload afresh in this process (model built again, same seed, so
    # the same shapes in the same order): from the second epoch on, every shape has been seen
    # (kernels loaded, library heuristics cached, the allocator holding what the workload
    # needs), which is the steady state a training or serving loop spends its time in.
    values, draws, epoch_step_s = [], [], []
    start = time.perf_counter()
    for _ in range(epochs):
        stamps = []
        workloads.random = _timed_random_module(stamps, torch.cuda.synchronize, draws)
        values += workloads.run(name, steps, "cuda")
        torch.cuda.synchronize()
        end = time.perf_counter()
        if len(stamps) % steps != 0 or not stamps:
            raise RuntimeError(f"{len(stamps)} rng.choice calls for {steps} steps: cannot find "
                               "step boundaries (workloads.py changed?)")
        per_step = len(stamps) // steps
        starts = stamps[::per_step] + [end]
        epoch_step_s.append([b - a for a, b in zip(starts, starts[1:])])
    step_s = epoch_step_s[-1]
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
                   "epochs": epochs, "values": values, "draws": draws, "step_s": step_s,
                   "epoch_step_s": epoch_step_s, "total_s": end - start,
                   "peak_reserved": peak_reserved, "peak_allocated": peak_allocated,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   **extra}, out)


# --- parent ------------------------------------------------------------------------------
def run_child(args, name, allocator, steps, warmup, out_dir, round_index):
    stem = f"torch_compare_{name}_{allocator}_r{round_index + 1}"
    result_path = os.path.join(out_dir, stem + ".json")
    log_path = os.path.join(out_dir, stem + ".log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, allocator, str(steps),
           str(warmup), result_path, "--epochs", str(args.epochs)]
    if args.lib:
        cmd += ["--lib", args.lib]
    if os.path.exists(result_path):
        os.remove(result_path)
    env = dict(os.environ)
    if allocator == "vram":
        env.update(vram_env(args.vram_env))
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            return None, f"{allocator} run timed out after {args.timeout} s, see {log_path}"
    if proc.returncode != 0 or not os.path.exists(result_path):
        return None, f"{allocator} run failed (rc {proc.returncode}), see {log_path}"
    with open(result_path) as f:
        return json.load(f), ""


def vram_env(items):
    """--vram-env KEY=VALUE items as a dict."""
    env = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vram-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def first_difference(a, b):
    """Index of the first step whose values differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(torch_run, vram_run, warmup):
    """One round: the two runs of a workload, warm-up steps excluded."""
    t = torch_run["step_s"][warmup:]
    v = vram_run["step_s"][warmup:]
    ratios = [b / a for a, b in zip(t, v) if a > 0]
    first_diff = first_difference(torch_run["values"], vram_run["values"])
    row = {
        # The shapes (decode: request sizes and lengths) both runs drew, in order: the paired
        # ratio compares like with like only when these agree.
        "same_draws": torch_run.get("draws") == vram_run.get("draws"),
        "identical": first_diff is None,
        "first_differing_step": first_diff,
        "timed_steps": len(t),
        "torch_median_step_ms": statistics.median(t) * 1e3,
        "vram_median_step_ms": statistics.median(v) * 1e3,
        "step_ratio_median": statistics.median(ratios),
        "step_ratios": ratios,
        "torch_peak_reserved": torch_run["peak_reserved"],
        "vram_peak_reserved": vram_run["peak_reserved"],
        "torch_peak_allocated": torch_run["peak_allocated"],
        "vram_peak_allocated": vram_run["peak_allocated"],
    }
    # With several epochs: the first one's paired ratio too (shapes seen for the first time,
    # the allocator growing), steps after DEFAULT_WARMUP, for the record.
    t_epochs, v_epochs = torch_run.get("epoch_step_s", []), vram_run.get("epoch_step_s", [])
    if len(t_epochs) > 1 and len(v_epochs) > 1:
        skip = DEFAULT_WARMUP.get(torch_run["workload"], 0)
        first = [b / a for a, b in zip(t_epochs[0][skip:], v_epochs[0][skip:]) if a > 0]
        row["first_epoch_step_ratio_median"] = statistics.median(first) if first else None
    row["time_target_met"] = row["step_ratio_median"] <= TIME_TARGET
    row["memory_target_met"] = row["vram_peak_reserved"] <= row["torch_peak_reserved"]
    return row


def aggregate(rounds):
    """Folds the rounds of one workload into its row. `rounds`: one entry per round, in
    order, each {"order": [first, second], "runs": {"torch": run, "vram": run},
    "row": compare(...)}."""
    rows = [r["row"] for r in rounds]
    differing = next((i for i, r in enumerate(rows) if not r["identical"]), None)
    reference = rounds[0]["runs"]["torch"]["values"]
    across = all(r["runs"][a]["values"] == reference for r in rounds for a in ("torch", "vram"))
    per_round_ratio = [r["step_ratio_median"] for r in rows]
    draws = rounds[0]["runs"]["torch"].get("draws")
    row = {
        "same_draws": all(r["runs"][a].get("draws") == draws for r in rounds
                          for a in ("torch", "vram")),
        "identical": differing is None,
        "first_differing_step": None if differing is None else rows[differing][
            "first_differing_step"],
        "first_differing_round": None if differing is None else differing + 1,
        "identical_across_rounds": across,
        "rounds": len(rows),
        "timed_steps": rows[0]["timed_steps"],
        "timed_steps_total": sum(r["timed_steps"] for r in rows),
        "torch_median_step_ms": statistics.median(r["torch_median_step_ms"] for r in rows),
        "vram_median_step_ms": statistics.median(r["vram_median_step_ms"] for r in rows),
        "step_ratio_median": statistics.median(per_round_ratio),
        "step_ratio_min": min(per_round_ratio),
        "step_ratio_max": max(per_round_ratio),
        "step_ratio_rounds": per_round_ratio,
        "step_ratio_pooled": statistics.median(x for r in rows for x in r["step_ratios"]),
        "first_epoch_step_ratio_rounds": [r.get("first_epoch_step_ratio_median") for r in rows],
        "torch_peak_reserved": max(r["torch_peak_reserved"] for r in rows),
        "vram_peak_reserved": max(r["vram_peak_reserved"] for r in rows),
        "torch_peak_allocated": max(r["torch_peak_allocated"] for r in rows),
        "vram_peak_allocated": max(r["vram_peak_allocated"] for r in rows),
    }
    row["step_ms_ratio"] = row["vram_median_step_ms"] / row["torch_median_step_ms"]
    row["time_target_met"] = row["step_ratio_median"] <= TIME_TARGET
    row["time_target_met_every_round"] = row["step_ratio_max"] <= TIME_TARGET
    row["memory_target_met"] = row["vram_peak_reserved"] <= row["torch_peak_reserved"]
    # `runs`: round 1, in the shape of the single-round output; `round_results`: every round.
    row["runs"] = {k: {f: v[f] for f in RUN_FIELDS} for k, v in rounds[0]["runs"].items()}
    row["round_results"] = [
        {"round": i + 1, "order": r["order"],
         **{k: v for k, v in r["row"].items() if k != "step_ratios"},
         "runs": {k: {f: v[f] for f in RUN_FIELDS + ("peak_reserved", "peak_allocated")}
                  for k, v in r["runs"].items()}}
        for i, r in enumerate(rounds)]
    return row


def markdown(rows, meta):
    mib = 1 << 20
    lines = [
        f"PyTorch {meta.get('torch', '?')} on {meta.get('device', '?')}; {meta.get('rounds', '?')}"
        " rounds, each a fresh process per allocator, who goes first alternating between rounds "
        f"and workloads; vram environment {meta.get('vram_env') or 'default'}; "
        + (f"{meta['epochs']} epochs per run, the last one timed (every shape seen before)"
           if meta.get("epochs", 1) > 1 else "steps timed after warm-up")
        + "; median step = median over rounds of each run's median; step ratio = "
        "median over rounds of the paired per-round ratio (median over steps of vram/PyTorch; "
        f"target <= {TIME_TARGET}), spread = min..max of the per-round ratios; peak reserved = "
        "max over rounds of each whole run's peak (target vram <= PyTorch).",
        "",
        "| workload | identical results | timed steps | PyTorch median step (ms) | vram median "
        "step (ms) | step ratio | ratio spread (min..max) | PyTorch peak reserved (MiB) | "
        "vram peak reserved (MiB) | targets |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | run failed: {row['error']} | | | | | | | | |")
            continue
        met = [("results" if row["identical"] else "RESULTS DIFFER"),
               ("time" if row["time_target_met"] else "time MISSED"),
               ("memory" if row["memory_target_met"] else "memory MISSED")]
        identical = ("yes" if row["identical"] else "NO (round %s, step %s)" % (
            row["first_differing_round"], row["first_differing_step"]))
        lines.append(
            f"| {name} | {identical} | {row['rounds']} x {row['timed_steps']} | "
            f"{row['torch_median_step_ms']:.2f} | {row['vram_median_step_ms']:.2f} | "
            f"{row['step_ratio_median']:.4f} | {row['step_ratio_min']:.4f}.."
            f"{row['step_ratio_max']:.4f} | {row['torch_peak_reserved'] / mib:.0f} | "
            f"{row['vram_peak_reserved'] / mib:.0f} | {', '.join(met)} |")
        if row["identical"] and not row["identical_across_rounds"]:
            notes.append(f"{name}: the results differ between rounds (the workload is not "
                         "repeatable across processes), though each round's two allocators "
                         "agree")
        firsts = [x for x in row.get("first_epoch_step_ratio_rounds", []) if x is not None]
        if firsts:
            notes.append(f"{name}: first epoch (new shapes, allocator growing) per-round step "
                         f"ratios {min(firsts):.4f}..{max(firsts):.4f}, median "
                         f"{statistics.median(firsts):.4f}")
        if not row["same_draws"]:
            notes.append(f"{name}: the runs drew different shapes, so the step ratios pair "
                         "unlike steps (the workload's seeding changed?)")
    if notes:
        lines += [""] + [f"Note: {n}." for n in notes]
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
        p.add_argument("--epochs", type=int, default=1)
        a = p.parse_args()
        name, alloc, steps, warmup, out = a.child
        child(name, alloc, int(steps), int(warmup), out, a.lib, a.epochs)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--lib", default=os.environ.get("VRAM_TORCH_LIB"),
                   help="libvram_torch.so (default: $VRAM_TORCH_LIB or a build*/ folder)")
    p.add_argument("--workloads", default=",".join(DEFAULT_STEPS))
    p.add_argument("--steps", default="",
                   help="steps per run, warm-up included, e.g. conv_training=40,"
                   "decode_growing_caches=6")
    p.add_argument("--warmup", default="", help="same form as --steps")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="fresh-process runs per allocator and workload (default %(default)s)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help="times each run goes through its steps, in one process; the last "
                   "epoch is timed (default %(default)s: every timed step has a shape seen "
                   "before); 1: the first and only pass is timed after --warmup steps")
    p.add_argument("--timeout", type=int, default=300, help="seconds per child run")
    p.add_argument("--vram-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the vram runs only (repeatable)")
    args = p.parse_args()
    vram_env(args.vram_env)  # bad items fail before any run
    os.makedirs(args.out_dir, exist_ok=True)
    if args.epochs < 1:
        raise SystemExit("--epochs must be >= 1")
    steps = parse_counts(args.steps, DEFAULT_STEPS if args.epochs == 1 else DEFAULT_EPOCH_STEPS)
    # With several epochs the earlier ones are the warm-up: the timed epoch excludes nothing
    # unless asked.
    warmup = parse_counts(args.warmup, DEFAULT_WARMUP if args.epochs == 1 else
                          {name: 0 for name in DEFAULT_STEPS})
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    names = list(filter(None, args.workloads.split(",")))
    for name in names:
        if name not in DEFAULT_STEPS:
            raise SystemExit(f"unknown workload {name!r}")
        if warmup[name] >= steps[name]:
            raise SystemExit(f"{name}: warm-up {warmup[name]} >= steps {steps[name]}")
    began = time.time()
    meta, status = {}, 0
    done = {name: [] for name in names}  # the completed rounds of each workload
    errors = {}
    # Rounds outermost: each workload's rounds are spread over the whole run, so a drift of
    # the machine lands on both allocators of some round rather than on one workload.
    for r in range(args.rounds):
        for i, name in enumerate(names):
            if name in errors:
                continue  # a failed workload is not retried in later rounds
            order = ["torch", "vram"] if (r + i) % 2 == 0 else ["vram", "torch"]
            runs, failed = {}, []
            for alloc in order:
                started = time.time()
                run, error = run_child(args, name, alloc, steps[name], warmup[name],
                                       args.out_dir, r)
                print(f"round {r + 1}/{args.rounds} {name} / {alloc}: "
                      f"{'ok' if run else error} ({time.time() - started:.1f} s)", flush=True)
                if run:
                    runs[alloc] = run
                    meta = {"torch": run["torch"], "device": run["device"]}
                else:
                    failed.append(error)
            if failed:
                errors[name] = f"round {r + 1}: " + "; ".join(failed)
                continue
            row = compare(runs["torch"], runs["vram"], warmup[name])
            done[name].append({"order": order, "runs": runs, "row": row})
            print(f"round {r + 1}/{args.rounds} {name}: step ratio {row['step_ratio_median']:.4f}"
                  f" (median step {row['torch_median_step_ms']:.2f} / "
                  f"{row['vram_median_step_ms']:.2f} ms), identical {row['identical']}",
                  flush=True)
    rows = {}
    for name in names:
        if name in errors:
            rows[name] = {"error": errors[name]}
            status = 2
            continue
        rows[name] = aggregate(done[name])
        if not rows[name]["identical"] and status == 0:
            status = 1
    elapsed = time.time() - began
    meta.update({"rounds": args.rounds, "epochs": args.epochs, "elapsed_s": elapsed,
                 "vram_env": vram_env(args.vram_env)})
    table = markdown(rows, meta)
    with open(os.path.join(args.out_dir, "torch_compare.json"), "w") as f:
        json.dump({"meta": meta, "steps": steps, "warmup": warmup, "rounds": args.rounds,
                   "epochs": args.epochs,
                   "elapsed_s": elapsed, "workloads": rows}, f, indent=1)
    with open(os.path.join(args.out_dir, "torch_compare.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"{elapsed:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
