"""Converts a PyTorch memory snapshot (torch.cuda.memory._snapshot(), recorded with
torch.cuda.memory._record_memory_history) into RMM logging_resource_adaptor CSV:

    Thread,Time,Action,Pointer,Size,Stream

    python3 tools/torch/snapshot_to_csv.py SNAPSHOT.pickle OUT.csv[.gz]

'alloc' -> allocate; 'free_completed' -> deallocate (the moment the caching allocator may
hand the block out again); every other action (free_requested, segment_*, snapshot, oom)
is dropped. Only device 0's trace is converted unless --device says otherwise.
Needs no torch: a snapshot pickle holds plain lists and dicts.
"""
import argparse
import gzip
import pickle
import sys

ACTIONS = {"alloc": "allocate", "free_completed": "deallocate"}


def write_csv(snapshot, out, device: int = 0) -> int:
    """Writes the CSV of one device's trace to the text stream `out`; returns the rows."""
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        raise SystemExit(f"snapshot has no trace for device {device} ({len(traces)} devices)")
    out.write("Thread,Time,Action,Pointer,Size,Stream\n")
    rows = 0
    for index, entry in enumerate(traces[device]):
        action = ACTIONS.get(entry.get("action"))
        if action is None:
            continue
        time = entry.get("time_us", index)
        out.write(f"0,{time},{action},0x{entry['addr']:x},{entry['size']},{entry.get('stream', 0)}\n")
        rows += 1
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("out")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt", newline="") as out:
        rows = write_csv(snapshot, out, args.device)
    print(f"{rows} events -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
