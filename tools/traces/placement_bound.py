"""What placement alone could reach on a trace, with the whole trace known in advance.

An online allocator places each block when it is asked for, without knowing when it will be
freed; a pool that never moves physical memory between addresses holds at least the address
span its placement touches. This script places the trace's blocks (over --min-bytes,
512-byte rounding, streams ignored) with the whole trace known beforehand: blocks sorted by
a key (size, lifetime, or both, largest first), each at the lowest address where it
overlaps no block already placed whose lifetime overlaps its own (the greedy offline
planners ML compilers use for activation memory). It reports the highest address any block
reaches, over the trace's peak live bytes (all blocks), next to the online best fit's span
over one address range (the rule of DevicePool's large tier and of remap_model.py's
"never"). The offline figure bounds the optimum from above (a clairvoyant placement needs
at most that span); it is not a bound for an online pool, which can beat a greedy planner on
some traces (decode_streams) and, knowing no free time, cannot expect to reach it on others
(bench/RESULTS.md, "Where the transformer trace's memory goes").

    python3 tools/traces/placement_bound.py TRACE.csv.gz [--min-bytes 1048577]
"""
import argparse
import bisect
import gzip

from remap_model import release_range


def load_lifetimes(path, min_bytes):
    """(alloc index, free index, rounded bytes) per block of at least min_bytes, and the
    trace's peak live bytes over all blocks."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [line.strip().split(",") for line in f][1:]
    started, blocks = {}, []
    live = peak = 0
    for index, row in enumerate(rows):
        if len(row) < 5:
            continue
        key, size = row[3], int(row[4])
        if row[2] == "allocate":
            started[key] = (index, size)
            live += size
            peak = max(peak, live)
        elif key in started:
            begin, size = started.pop(key)
            live -= size
            if size >= min_bytes:
                blocks.append((begin, index, (size + 511) // 512 * 512))
    for begin, size in started.values():  # still live at the end
        if size >= min_bytes:
            blocks.append((begin, len(rows), (size + 511) // 512 * 512))
    return blocks, peak


def offline_span(blocks, order):
    """Greedy offline placement in the given order; returns the highest end address."""
    placed = []  # (begin, end, lo, hi)
    top = 0
    for i in order:
        begin, end, size = blocks[i]
        busy = sorted((lo, hi) for b, e, lo, hi in placed if b < end and e > begin)
        addr = 0
        for lo, hi in busy:
            if lo - addr >= size:
                break
            addr = max(addr, hi)
        placed.append((begin, end, addr, addr + size))
        top = max(top, addr + size)
    return top


def online_best_fit_span(blocks):
    """Best fit over one address range in trace order (smallest fitting free range, lowest
    address on ties, free neighbours merge): the highest end address it reaches."""
    events = sorted([(b, 1, i) for i, (b, _, _) in enumerate(blocks)] +
                    [(e, 0, i) for i, (_, e, _) in enumerate(blocks)])
    free, addrs, where = {0: 1 << 60}, [0], {}
    top = 0
    for _, is_alloc, i in events:
        size = blocks[i][2]
        if is_alloc:
            best = min((a for a in addrs if free[a] >= size), key=lambda a: (free[a], a))
            rest = free.pop(best) - size
            addrs.remove(best)
            if rest:
                free[best + size] = rest
                bisect.insort(addrs, best + size)
            where[i] = best
            top = max(top, best + size)
            continue
        release_range(free, addrs, where.pop(i), size)
    return top


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--min-bytes", type=int, default=(1 << 20) + 1,
                        help="place blocks of at least this size (default: over 1 MiB, "
                        "DevicePool's large blocks)")
    args = parser.parse_args()
    for path in args.traces:
        blocks, peak = load_lifetimes(path, args.min_bytes)
        print(f"{path}: {len(blocks)} blocks of >= {args.min_bytes} B, "
              f"peak live {peak / 2**30:.3f} GiB (all blocks)")
        online = online_best_fit_span(blocks)
        print(f"  online best fit, one range:  span {online / 2**30:.3f} GiB = "
              f"{online / peak:.3f}x")
        keys = {
            "size": lambda i: -blocks[i][2],
            "lifetime": lambda i: -(blocks[i][1] - blocks[i][0]),
            "size x lifetime": lambda i: -blocks[i][2] * (blocks[i][1] - blocks[i][0]),
        }
        for name, key in keys.items():
            span = offline_span(blocks, sorted(range(len(blocks)), key=key))
            print(f"  offline, largest {name} first: span {span / 2**30:.3f} GiB = "
                  f"{span / peak:.3f}x", flush=True)


if __name__ == "__main__":
    main()
