"""A model, not the pool: what giving free 2 MiB granules back and mapping them again
elsewhere would buy on a trace, and what it would cost in driver calls (bench/RESULTS.md,
"Where the transformer trace's memory goes"). DevicePool's large tier maps granules in runs and keeps them mapped; its peak
reserved is the span of address space its best-fit placement ever touched. This script
replays a trace's large blocks (over 1 MiB) with the same rule (best fit over one address
range, smallest fitting range, ties: lowest address, 512-byte rounding, free neighbours
merge; streams ignored) and reports, over PASSES passes:

  never:     granules stay mapped once mapped (what the pool does): peak mapped bytes
  bound:     the peak of granules that live blocks touch (any remapping scheme's floor
             under this placement)
  steal H:   physical granules limited to the peak of live bytes so far times (1 + H); a
             block that needs more unmaps idle granules (least recently used first) and maps
             their memory under itself; placement prefers free ranges already mapped. Reports
             peak physical bytes and per pass the maps and unmaps (one call per contiguous
             stretch of granules), the driver calls a remapping pool would make.

    python3 tools/traces/remap_model.py TRACE.csv.gz [--passes 3] [--headroom 0.0625,0.13]

Ratios are to the trace's peak live bytes (all blocks, small ones included).
"""
import argparse
import bisect
import collections
import gzip

GRANULE = 2 << 20
HUGE = 1 << 44


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [line.strip().split(",") for line in f][1:]
    return [(r[2] == "allocate", r[3], int(r[4])) for r in rows if len(r) >= 5]


def granules(addr, size):
    return range(addr // GRANULE, (addr + size - 1) // GRANULE + 1)


def stretches(sorted_granules):
    return sum(1 for i, g in enumerate(sorted_granules) if i == 0 or sorted_granules[i - 1] != g - 1)


def release_range(free, addrs, addr, size):
    """Gives [addr, addr + size) back to the free ranges (free: start -> size; addrs: the
    starts, sorted), merged with a free neighbour on either side."""
    i = bisect.bisect_left(addrs, addr)
    if i < len(addrs) and addrs[i] == addr + size:
        size += free.pop(addrs[i])
        addrs.pop(i)
    if i > 0 and addrs[i - 1] + free[addrs[i - 1]] == addr:
        free[addrs[i - 1]] += size
    else:
        free[addr] = size
        addrs.insert(i, addr)


def replay(events, passes, headroom):
    """headroom None: never unmap. Returns (peak live, peak mapped/physical, peak touched, calls)."""
    free = {0: HUGE}
    addrs = [0]
    live = {}
    touched = collections.Counter()
    mapped = set()
    physical = 0
    idle_since = {}
    used = used_peak = live_bytes = live_peak = 0
    peak_physical = peak_touched = n_touched = 0
    calls = [collections.Counter() for _ in range(passes)]

    def release(addr, size):
        release_range(free, addrs, addr, size)

    for p in range(passes):
        clock = 0
        for is_alloc, key, size in events:
            clock += 1
            live_bytes += size if is_alloc else -size
            live_peak = max(live_peak, live_bytes)
            if size <= (1 << 20):
                continue
            need = (size + 511) // 512 * 512
            if not is_alloc:
                addr, need = live.pop(key)
                used -= need
                for g in granules(addr, need):
                    touched[g] -= 1
                    if touched[g] == 0:
                        idle_since[g] = (p, clock)
                        n_touched -= 1
                release(addr, need)
                continue
            on_mapped = lambda a: all(g in mapped for g in granules(a, need))
            best = None
            if headroom is not None:  # prefer a range whose granules are mapped
                for a in addrs:
                    if free[a] >= need and (best is None or free[a] < free[best]) and on_mapped(a):
                        best = a
            if best is None:
                for a in addrs:
                    if free[a] >= need and (best is None or free[a] < free[best]):
                        best = a
            rest = free.pop(best) - need
            addrs.remove(best)
            if rest:
                free[best + need] = rest
                bisect.insort(addrs, best + need)
            live[key] = (best, need)
            used += need
            used_peak = max(used_peak, used)
            new = [g for g in granules(best, need) if g not in mapped]
            if new:
                short = len(new) - (physical - len(mapped))
                if short > 0 and headroom is not None:
                    budget = int(used_peak * (1 + headroom) / GRANULE) + 1
                    steal = min(short, max(0, physical + short - budget))
                    if steal:
                        under = set(granules(best, need))
                        idle = sorted((idle_since.get(g, (0, 0)), g) for g in mapped
                                      if touched[g] == 0 and g not in under)
                        victims = sorted(g for _, g in idle[:steal])
                        calls[p]["unmaps"] += stretches(victims)
                        mapped.difference_update(victims)
                    short = len(new) - (physical - len(mapped))
                if short > 0:
                    physical += short
                calls[p]["maps"] += stretches(new)
                mapped.update(new)
                peak_physical = max(peak_physical, physical)
            for g in granules(best, need):
                if touched[g] == 0:
                    n_touched += 1
                touched[g] += 1
            peak_touched = max(peak_touched, n_touched)
        for key in list(live):  # the pass ends: what it left live goes back
            addr, need = live.pop(key)
            used -= need
            for g in granules(addr, need):
                touched[g] -= 1
                if touched[g] == 0:
                    n_touched -= 1
            release(addr, need)
        live_bytes = 0
    return live_peak, peak_physical * GRANULE, peak_touched * GRANULE, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--headroom", default="0.0625,0.13")
    args = parser.parse_args()
    events = load(args.trace)
    live_peak, never, touched, _ = replay(events, args.passes, None)
    print(f"{args.trace}: peak live {live_peak / 2**30:.3f} GiB")
    print(f"  never:  peak mapped {never / 2**30:.3f} GiB = {never / live_peak:.3f}x")
    print(f"  bound:  peak of granules live blocks touch {touched / 2**30:.3f} GiB = "
          f"{touched / live_peak:.3f}x")
    for h in (float(x) for x in args.headroom.split(",")):
        _, phys, _, calls = replay(events, args.passes, h)
        per_pass = "; ".join(f"pass {i + 1}: {c['maps']} maps, {c['unmaps']} unmaps"
                             for i, c in enumerate(calls))
        print(f"  steal {h:g}: peak physical {phys / 2**30:.3f} GiB = {phys / live_peak:.3f}x; "
              f"{per_pass}")


if __name__ == "__main__":
    main()
