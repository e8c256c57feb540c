"""Sleep and wake from PyTorch: vram_torch's region/sleep/wake against torch_memory_saver's
region/pause/resume and the pinned link, in one run.

    python3 bench/torch_sleep.py [--json OUT.json] [--gib 8] [--cycles 3] [--many 10000]
                                 [--asleep-s 1]

Each allocator runs in a fresh interpreter (the allocator is chosen before CUDA starts):
  link   torch.empty(pin_memory=True) <-> a CUDA tensor, copy_ each way, 1 GiB, GB/s
  vram   vram_torch.enable(); weights (--gib GiB in 32 tensors) in region("weights"), a KV
         cache (--gib GiB) in region("kv", discardable=True), then --cycles timed cycles
         (one untimed cycle first: it pins the backup), the weights' cycles again with
         --asleep-s seconds between sleep and wake (weights_asleep); then --many tensors of
         64 KiB-4 MiB
         (log-uniform, fixed seed) in region("many")
  tms    torch_memory_saver (hook_mode "torch"), the same tensors with
         region(tag, enable_cpu_backup=True/False), pause/resume; reported absent when it is
         not installed (pip download torch-memory-saver==0.0.10, then pip install the wheel)
Each sleep/pause is timed on the host around the call after a torch.cuda.synchronize(), each
wake/resume from its call to a torch.cuda.synchronize() after it, and checked: the weights' contents after each wake equal those
before (a checksum per tensor), and torch.cuda.mem_get_info() shows the memory freed while
asleep. The table gives GB/s (weights, many) and ms per GiB (KV), with the fraction of the
link and vram's speed-up over torch_memory_saver. `vram bench --scenario sleep` runs this
file's tms child (--child tms --lines --many-sizes FILE) as its peer, with its own sizes.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

# Seconds between sleep and wake in the "weights_asleep" cycles (--asleep-s; `vram bench`
# passes its own): in an RL step the trainer runs between the two. A copy into device memory
# made within about 100 ms of the release of other memory ran about 10% below the link on an
# H100 (bench/RESULTS.md, "Sleep and wake"): a wake right after its sleep pays that.
ASLEEP_S = 1.0

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = 1 << 30
MiB = 1 << 20


# ---- child side ----------------------------------------------------------------------------

def _sizes_many(count, cap_bytes):
    rng = random.Random(42)
    sizes, total = [], 0
    for _ in range(count):
        n = int(math.exp(rng.uniform(math.log(64 * 1024), math.log(4 * MiB)))) // 256 * 256
        if total + n > cap_bytes:
            break
        sizes.append(n)
        total += n
    return sizes


def _many(args, cap_bytes):
    """The sizes of the many-tensor tag: --many-sizes FILE (one per line) or drawn here."""
    if args.many_sizes:
        with open(args.many_sizes) as f:
            return [int(line) for line in f if line.strip()]
    return _sizes_many(args.many, cap_bytes)


def _checksums(tensors):
    import torch

    return [int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors]


def _cycle(torch, go_sleep, go_wake, tensors, cycles, asleep_s=0.0):
    """Times `cycles` sleep/wake pairs after one untimed pair; checks contents and frees.
    asleep_s: seconds between the sleep and the wake (the trainer's step in an RL loop)."""
    expected = _checksums(tensors) if tensors else None
    sleep_s, wake_s, freed = [], [], []
    for cycle in range(cycles + 1):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        go_sleep()
        slept = time.perf_counter()
        free_asleep = torch.cuda.mem_get_info()[0]  # between the timed calls, in neither
        if asleep_s:
            time.sleep(asleep_s)
        waking = time.perf_counter()
        go_wake()
        torch.cuda.synchronize()
        woke = time.perf_counter()
        if tensors and _checksums(tensors) != expected:
            raise AssertionError(f"contents changed across cycle {cycle}")
        if cycle == 0:
            continue
        sleep_s.append(slept - start)
        wake_s.append(woke - waking)
        freed.append(free_asleep - free_before)
    return {"sleep_s": sleep_s, "wake_s": wake_s, "freed_bytes": freed}


def _make_tensors(torch, sizes):
    out = []
    for i, n in enumerate(sizes):
        t = torch.empty(n // 4, dtype=torch.int32, device="cuda")
        t.random_(0, 1 << 20)
        out.append(t)
    return out


def child_link(args):
    import torch

    n = GiB
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rates = {"to_host": [], "to_device": []}
    for r in range(6):
        for direction in ("to_host", "to_device"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if direction == "to_host":
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            if r:
                rates[direction].append(n / (time.perf_counter() - start) / 1e9)
    return rates


def child_vram(args):
    import torch
    import vram_torch

    vram_torch.enable()
    weights_bytes = int(args.gib * GiB)
    with vram_torch.region("weights"):
        weights = _make_tensors(torch, [weights_bytes // 32] * 32)
    with vram_torch.region("kv", discardable=True):
        kv = torch.empty(weights_bytes, dtype=torch.uint8, device="cuda")
    out = {"weights": _cycle(torch, lambda: vram_torch.sleep("weights"),
                             lambda: vram_torch.wake("weights"), weights, args.cycles),
           "weights_asleep": _cycle(torch, lambda: vram_torch.sleep("weights"),
                                    lambda: vram_torch.wake("weights"), weights, args.cycles,
                                    args.asleep_s),
           "kv": _cycle(torch, lambda: vram_torch.sleep("kv"), lambda: vram_torch.wake("kv"),
                        None, args.cycles)}
    del weights, kv
    torch.cuda.empty_cache()
    sizes = _many(args, torch.cuda.mem_get_info()[0] // 3)
    with vram_torch.region("many"):
        many = _make_tensors(torch, sizes)
    out["many"] = _cycle(torch, lambda: vram_torch.sleep("many"),
                         lambda: vram_torch.wake("many"), many, args.cycles)
    out["many_bytes"] = sum(sizes)
    out["many_count"] = len(sizes)
    out["many_copies"] = vram_torch.tag_stats("many")["copies"]
    out["weights_bytes"] = weights_bytes
    return out


def child_tms(args):
    import torch

    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as e:
        return {"absent": f"torch_memory_saver is not installed ({e})"}
    torch_memory_saver.hook_mode = "torch"
    weights_bytes = int(args.gib * GiB)
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        weights = _make_tensors(torch, [weights_bytes // 32] * 32)
    with torch_memory_saver.region(tag="kv", enable_cpu_backup=False):
        kv = torch.empty(weights_bytes, dtype=torch.uint8, device="cuda")
    out = {"weights": _cycle(torch, lambda: torch_memory_saver.pause("weights"),
                             lambda: torch_memory_saver.resume("weights"), weights, args.cycles),
           "weights_asleep": _cycle(torch, lambda: torch_memory_saver.pause("weights"),
                                    lambda: torch_memory_saver.resume("weights"), weights,
                                    args.cycles, args.asleep_s),
           "kv": _cycle(torch, lambda: torch_memory_saver.pause("kv"),
                        lambda: torch_memory_saver.resume("kv"), None, args.cycles)}
    del weights, kv
    torch.cuda.empty_cache()
    sizes = _many(args, torch.cuda.mem_get_info()[0] // 3)
    with torch_memory_saver.region(tag="many", enable_cpu_backup=True):
        many = _make_tensors(torch, sizes)
    out["many"] = _cycle(torch, lambda: torch_memory_saver.pause("many"),
                         lambda: torch_memory_saver.resume("many"), many, args.cycles)
    out["many_bytes"] = sum(sizes)
    out["many_count"] = len(sizes)
    out["weights_bytes"] = weights_bytes
    return out


def _print_lines(result):
    """`vram bench --scenario sleep` reads these: ABSENT/ERROR <text>, BYTES <part> <n>,
    SECONDS <part> <sleep|wake> <s> <s> ..."""
    if "absent" in result or "error" in result:
        kind = "ABSENT" if "absent" in result else "ERROR"
        text = result.get("absent") or result.get("error")
        print(kind, " ".join(str(text).split()), flush=True)
        return
    print("BYTES weights", result["weights_bytes"])
    print("BYTES weights_asleep", result["weights_bytes"])
    print("BYTES kv", result["weights_bytes"])
    print("BYTES many", result["many_bytes"])
    for part in ("weights", "weights_asleep", "kv", "many"):
        for step in ("sleep", "wake"):
            print("SECONDS", part, step, *(f"{s:.9f}" for s in result[part][step + "_s"]))
    sys.stdout.flush()


# ---- parent side ---------------------------------------------------------------------------

def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def _run_child(which, args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--gib", str(args.gib),
           "--cycles", str(args.cycles), "--many", str(args.many), "--asleep-s", str(args.asleep_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"rc {proc.returncode}", "stderr": proc.stderr[-4000:]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=("link", "vram", "tms"))
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--many", type=int, default=10000)
    parser.add_argument("--asleep-s", type=float, default=ASLEEP_S,
                        help="seconds between sleep and wake in the weights_asleep cycles")
    parser.add_argument("--many-sizes", help="a file of sizes, one per line (instead of --many)")
    parser.add_argument("--lines", action="store_true",
                        help="with --child: the result as plain lines (for `vram bench`)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not math.isfinite(args.asleep_s) or args.asleep_s < 0:
        parser.error(f"--asleep-s must be a finite number of seconds >= 0 (got {args.asleep_s})")
    if args.child:
        fn = {"link": child_link, "vram": child_vram, "tms": child_tms}[args.child]
        try:
            result = fn(args)
        except Exception as e:  # reported, the parent goes on with the others
            import traceback

            result = {"error": repr(e), "trace": traceback.format_exc()}
        if args.lines:
            _print_lines(result)
        else:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    results = {name: _run_child(name, args) for name in ("link", "vram", "tms")}
    link = results["link"]
    link_d2h = _median(link.get("to_host", []))
    link_h2d = _median(link.get("to_device", []))
    rows = [("pinned link", "device to host", f"{link_d2h:.1f} GB/s", ""),
            ("pinned link", "host to device", f"{link_h2d:.1f} GB/s", "")]
    summary = {"link_to_host_gbs": link_d2h, "link_to_device_gbs": link_h2d,
               "asleep_s": args.asleep_s}
    for name in ("vram", "tms"):
        r = results[name]
        if "absent" in r or "error" in r:
            rows.append((name, "-", r.get("absent") or r.get("error"), ""))
            continue
        for part, nbytes in (("weights", r["weights_bytes"]),
                             ("weights_asleep", r["weights_bytes"]), ("many", r["many_bytes"])):
            for step, link_rate in (("sleep_s", link_d2h), ("wake_s", link_h2d)):
                rate = nbytes / _median(r[part][step]) / 1e9
                summary[f"{name}_{part}_{step[:-2]}_gbs"] = rate
                rows.append((name, f"{part} {step[:-2]}", f"{rate:.1f} GB/s",
                             f"{rate / link_rate:.0%} of link"))
        gib = r["weights_bytes"] / GiB
        for step in ("sleep_s", "wake_s"):
            ms = _median(r["kv"][step]) * 1e3
            summary[f"{name}_kv_{step[:-2]}_ms_per_gib"] = ms / gib
            rows.append((name, f"kv {step[:-2]}", f"{ms:.2f} ms", f"{ms / gib:.2f} ms/GiB"))
    for key in ("weights_sleep", "weights_wake", "weights_asleep_sleep", "weights_asleep_wake",
                "many_sleep", "many_wake"):
        mine, peer = summary.get(f"vram_{key}_gbs"), summary.get(f"tms_{key}_gbs")
        if mine and peer:
            summary[f"speedup_{key}"] = mine / peer
            rows.append(("vram / tms", key, f"{mine / peer:.1f}x", ""))
    width = max(len(r[1]) for r in rows)
    for r in rows:
        print(f"{r[0]:<12} {r[1]:<{width}}  {r[2]:>14}  {r[3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)
    failed = any("error" in results[name] for name in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
