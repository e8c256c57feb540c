#!/usr/bin/env python3
"""Convert a PyTorch CUDA memory snapshot into the trace CSV `vram replay` reads.

Record the snapshot in the workload:

    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ... run the model ...
    snapshot = torch.cuda.memory._snapshot()
    with open("model.pickle", "wb") as f:
        pickle.dump(snapshot, f)

then convert it (torch is not needed for the conversion):

    python3 tools/torch/snapshot_to_csv.py model.pickle bench/traces/model.csv.gz

Output: RMM logging_resource_adaptor CSV, `Thread,Time,Action,Pointer,Size,Stream`,
gzip-compressed when the output name ends in .gz. Mapping of the device_traces entries:
  alloc           -> allocate
  free_completed  -> deallocate (the moment the block is reusable by the allocator)
  oom             -> allocate failure (pointer 0x0)
  free_requested, segment_*, snapshot and anything else -> left out
Thread is 0; Time is the entry's time_us (or its index with --time index, or when the
entry has no time_us). When the history ring (max_entries) overflowed, the trace starts
with frees of blocks allocated before it; `vram replay` reports and skips those.
The output is written to a temporary file and renamed once complete.
"""

import argparse
import gzip
import io
import os
import pickle
import sys
import tempfile

ACTIONS = {"alloc": "allocate", "free_completed": "deallocate", "oom": "allocate failure"}


class _SnapshotUnpickler(pickle.Unpickler):
    """A snapshot holds only dicts, lists, strings and numbers: refuse anything else."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"snapshot pickle refers to {module}.{name}; expected plain data "
            "(the output of torch.cuda.memory._snapshot())")


def load_snapshot(path):
    with open(path, "rb") as f:
        return _SnapshotUnpickler(f).load()


def device_trace(snapshot, device):
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError("not a torch.cuda.memory._snapshot() result (no 'device_traces'); "
                         "was _record_memory_history enabled?")
    traces = snapshot["device_traces"]
    if device < 0 or device >= len(traces):
        raise ValueError(f"device {device} not in the snapshot (it has {len(traces)} device "
                         "traces)")
    return traces[device]


def convert(entries, out, time_mode="time_us"):
    """Writes the CSV for one device's trace entries to the text stream `out`.

    Returns a dict of counts: actions written and left out, frees without an allocation.
    """
    counts = {"allocate": 0, "deallocate": 0, "allocate failure": 0, "left_out": 0,
              "free_without_alloc": 0}
    live = set()
    out.write("Thread,Time,Action,Pointer,Size,Stream\n")
    for index, entry in enumerate(entries):
        action = ACTIONS.get(entry.get("action"))
        if action is None:
            counts["left_out"] += 1
            continue
        if time_mode == "time_us" and "time_us" in entry:
            time = entry["time_us"]
        else:
            time = index
        addr = 0 if action == "allocate failure" else int(entry.get("addr", 0))
        size = int(entry.get("size", 0))
        stream = int(entry.get("stream", 0))
        if action == "allocate":
            live.add(addr)
        elif action == "deallocate":
            if addr in live:
                live.discard(addr)
            else:
                counts["free_without_alloc"] += 1
        counts[action] += 1
        out.write(f"0,{time},{action},{addr:#x},{size},{stream}\n")
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="pickle written from torch.cuda.memory._snapshot()")
    parser.add_argument("output", help="CSV to write (.csv or .csv.gz)")
    parser.add_argument("--device", type=int, default=0, help="device trace to convert (0)")
    parser.add_argument("--time", choices=["time_us", "index"], default="time_us",
                        help="Time column: the entry's time_us (default) or its index")
    args = parser.parse_args(argv)
    try:
        entries = device_trace(load_snapshot(args.snapshot), args.device)
    except (OSError, pickle.UnpicklingError, ValueError, EOFError) as error:
        print(f"snapshot_to_csv: {args.snapshot}: {error}", file=sys.stderr)
        return 2
    directory = os.path.dirname(os.path.abspath(args.output))
    fd, temp = tempfile.mkstemp(prefix=".trace-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as raw:
            if args.output.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed:
                    with io.TextIOWrapper(packed, encoding="ascii", newline="\n") as text:
                        counts = convert(entries, text, args.time)
            else:
                with io.TextIOWrapper(raw, encoding="ascii", newline="\n") as text:
                    counts = convert(entries, text, args.time)
        os.chmod(temp, 0o644)
        os.replace(temp, args.output)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    print(f"{args.output}: {counts['allocate']} allocate, {counts['deallocate']} deallocate, "
          f"{counts['allocate failure']} allocate failure; {counts['left_out']} other entries "
          f"left out; {counts['free_without_alloc']} frees of blocks allocated before the "
          "recorded history", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
