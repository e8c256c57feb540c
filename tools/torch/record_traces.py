"""Records allocation traces of the workloads in workloads.py on a GPU and writes them as
RMM logging_resource_adaptor CSV (Thread,Time,Action,Pointer,Size,Stream), gzip-compressed.

    python3 tools/torch/record_traces.py OUT_DIR [--steps N]

A trace entry 'alloc' becomes `allocate`, 'free_completed' (the moment PyTorch's caching
allocator may reuse the block) becomes `deallocate`; segment events and 'free_requested'
are not allocations of the program and are dropped. Each workload runs in a fresh process
state: the allocator's cache is emptied and its history restarted before recording.
"""
import argparse
import gzip
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from snapshot_to_csv import convert, device_trace  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=0, help="0: each workload's default")
    parser.add_argument("--only", default="", help="comma-separated workload names")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    defaults = {"transformer_training": 24, "decode_growing_caches": 8, "conv_training": 24,
                "decode_streams": 12}
    names = [n for n in workloads.WORKLOADS if not args.only or n in args.only.split(",")]
    for name in names:
        steps = args.steps or defaults[name]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=2_000_000)
        start = time.time()
        results = workloads.run(name, steps)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        stats = torch.cuda.memory_stats()
        path = os.path.join(args.out_dir, f"{name}.csv.gz")
        with gzip.open(path, "wt", newline="") as out:
            counts = convert(device_trace(snapshot, torch.cuda.current_device()), out)
        events = counts["allocate"] + counts["deallocate"]
        print(f"{name}: {steps} steps in {time.time() - start:.1f} s, {events} events -> {path}; "
              f"torch peak allocated {stats['allocated_bytes.all.peak'] / 2**20:.0f} MiB, "
              f"peak reserved {stats['reserved_bytes.all.peak'] / 2**20:.0f} MiB, "
              f"first/last result {results[0]:.4f}/{results[-1]:.4f}", flush=True)
        del snapshot


if __name__ == "__main__":
    main()
