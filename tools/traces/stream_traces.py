"""Synthetic multi-stream traces: an engine with a stream per request. Stream i % N
allocates block i (3, 5 or 9 MiB, random.Random(1)) and frees it on the same stream 2*N
allocations later, 40,000 allocations in all. They show how a pool shares free memory
between streams (DevicePool before 08a64a2: 97x the live bytes with 16 streams, growing
every pass; docs/RELIABILITY.md).

    python3 tools/traces/stream_traces.py OUT_DIR
    ./build/vram replay --host-only --passes 3 OUT_DIR/*.csv     # or on a GPU, with peers

Writes RMM logging_resource_adaptor CSV: streams1.csv, streams4.csv, streams8.csv,
streams16.csv (the stream column is the stream's index; replay gives each its own stream).
"""
import os
import random
import sys

MIB = 1 << 20


def write(path, streams, allocations=40000):
    rng = random.Random(1)
    lines = ["Thread,Time,Action,Pointer,Size,Stream"]
    t = 0
    live = []
    for i in range(allocations):
        size = rng.choice([3 * MIB, 5 * MIB, 9 * MIB])
        pointer = hex(0x1000 + i * 0x100000000)
        stream = i % streams
        lines.append(f"0,{t},allocate,{pointer},{size},{stream}")
        t += 1
        live.append((pointer, size, stream))
        if len(live) > 2 * streams:
            p, s, st = live.pop(0)
            lines.append(f"0,{t},deallocate,{p},{s},{st}")
            t += 1
    for p, s, st in live:
        lines.append(f"0,{t},deallocate,{p},{s},{st}")
        t += 1
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for streams in (1, 4, 8, 16):
        write(os.path.join(out, f"streams{streams}.csv"), streams)


if __name__ == "__main__":
    main()
