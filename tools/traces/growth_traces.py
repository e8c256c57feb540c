"""Synthetic traces that only grow: every block stays live until the end, then all are freed.
They show what DevicePool's map-ahead (large_tier.virtual_map_ahead_bytes) costs in memory: reserved
bytes mapped before any block needs them (docs/RELIABILITY.md, "Virtual-memory tier in runs").

    python3 tools/traces/growth_traces.py OUT_DIR
    ./build/vram replay --host-only OUT_DIR/*.csv

Writes RMM logging_resource_adaptor CSV (the format `vram replay` reads):
  grow300x3M.csv    300 blocks of 3 MiB
  grow100x100M.csv  100 blocks of 100 MiB
  grow1000x10M.csv  1000 blocks of 10 MiB
  growmixed.csv     60 blocks drawn from 3, 7, 33, 129 and 513 MiB (random.Random(3))
"""
import os
import random
import sys

MIB = 1 << 20


def write(path, sizes):
    with open(path, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        t = 0
        for i, n in enumerate(sizes):
            t += 1
            f.write(f"0,{t},allocate,{hex(0x10000000 + i * 0x1000)},{n},0\n")
        for i, n in enumerate(sizes):
            t += 1
            f.write(f"0,{t},deallocate,{hex(0x10000000 + i * 0x1000)},{n},0\n")


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(3)
    write(os.path.join(out, "grow300x3M.csv"), [3 * MIB] * 300)
    write(os.path.join(out, "grow100x100M.csv"), [100 * MIB] * 100)
    write(os.path.join(out, "grow1000x10M.csv"), [10 * MIB] * 1000)
    write(os.path.join(out, "growmixed.csv"),
          [rng.choice([3 * MIB, 7 * MIB, 33 * MIB, 129 * MIB, 513 * MIB]) for _ in range(60)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
