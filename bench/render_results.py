"""Renders the JSON of `vram bench` or `vram replay` as the tables of bench/RESULTS.md.

    python3 bench/render_results.py bench/results/FILE.json [--scenario NAME]

Every figure is printed as the JSON stores it (six significant digits), never rounded again:
`vram bench --markdown` prints four digits from the unrounded values, which the JSON cannot
reproduce, so a run recorded with its own --markdown output is quoted from that instead.
`vram bench` JSON: the tables and verdict lines in the layout of `vram bench --markdown`,
one scenario (--scenario) or all (a ratio below 1 printed as 1/advantage, four digits).
`vram replay` JSON (--runs N --passes P): per trace the first pass and the repeated passes
of every allocator, the median run with the range of the runs, a verdict line per trace and
pass against the fastest allocator that is not vram's, and one for peak reserved over peak
live bytes against the caching peers (cudaMalloc, which caches nothing, left out); ratios
to four significant digits.
"""
import argparse
import json
import sys


def raw(text):
    """A figure as the JSON stores it (the tools write six significant digits)."""
    return text


def bench_markdown(data, scenario=None):
    out = []
    scenarios = []
    for m in data["results"]:
        if m["scenario"] not in scenarios:
            scenarios.append(m["scenario"])
    for name in scenarios:
        if scenario and name != scenario:
            continue
        if not scenario:
            out.append("\n### %s\n" % name)
        out.append("| parameter | allocator | median | p10 .. p90 | notes |")
        out.append("|---|---|---|---|---|")
        for m in data["results"]:
            if m["scenario"] != name:
                continue
            notes = "".join("%s=%s " % (k, raw(v)) for k, v in sorted(m["extra"].items()))
            allocator = "**%s**" % m["allocator"] if m["ours"] else m["allocator"]
            out.append("| %s | %s | %s %s | %s .. %s | %s|" % (
                m["parameter"], allocator, raw(m["median"]), m["unit"], raw(m["p10"]),
                raw(m["p90"]), notes))
        for v in data["verdicts"]:
            if v["scenario"] != name:
                continue
            advantage = float(v["advantage"])
            ratio = raw(v["advantage"]) if advantage >= 1 else "%.4g" % (1 / advantage)
            out.append("")
            out.append("Verdict %s: %s %s %s vs best peer %s %s %s: **%sx %s**" % (
                v["parameter"], v["ours"], raw(v["ours_value"]), v["unit"], v["best_peer"],
                raw(v["peer_value"]), v["unit"], ratio, "better" if advantage >= 1 else "worse"))
    return "\n".join(out) + "\n"


def replay_markdown(data):
    passes = int(data.get("passes_per_run") or 1)
    out = ["| parameter | allocator | median | range of the runs | notes |", "|---|---|---|---|---|"]
    verdicts = []
    peaks = {t["trace"]: t["peak_live_bytes"] for t in data["traces"]}
    for trace in [t["trace"] for t in data["traces"]]:
        records = [r for r in data["records"] if r["trace"] == trace]
        # (label, ns/op key, its runs, driver allocations in those passes)
        kinds = [("first pass", "ns_per_op", "ns_per_op_runs",
                  lambda r: (r.get("pass_upstream_allocations") or [r["upstream_allocations"]])[0])]
        if passes >= 2:
            kinds.append(("passes 2-%d" % passes, "warm_ns_per_op", "warm_ns_per_op_runs",
                          lambda r: r.get("warm_upstream_allocations")))
        for label, key, runs_key, upstream in kinds:
            parameter = "%s, %s" % (trace, label)
            for r in records:
                if r.get(key) is None:
                    continue
                runs = r.get(runs_key) or [r[key]]
                notes = "peak_live_bytes=%s reserved_over_live=%s " % (
                    raw(peaks[trace]), raw(r["reserved_over_live"]))
                if upstream(r) is not None:
                    notes += "upstream_allocations=%s " % raw(upstream(r))
                ours = r["allocator"].startswith("vram")
                allocator = "**%s**" % r["allocator"] if ours else r["allocator"]
                out.append("| %s | %s | %s ns/op | %s .. %s | %s|" % (
                    parameter, allocator, raw(r[key]), raw(min(runs, key=float)),
                    raw(max(runs, key=float)), notes))
            ours = [r for r in records if r["allocator"] == "vram DevicePool" and r.get(key)]
            peers = [r for r in records if not r["allocator"].startswith("vram") and r.get(key)]
            if ours and peers:
                best = min(peers, key=lambda r: float(r[key]))
                verdicts.append(verdict("%s, %s" % (trace, label), ours[0][key], best["allocator"],
                                        best[key], "ns/op", lower_is_better=True))
        # Memory: against the caching peers (cudaMalloc caches nothing: it holds the live bytes).
        ours = [r for r in records if r["allocator"] == "vram DevicePool"]
        peers = [r for r in records
                 if not r["allocator"].startswith("vram") and r["allocator"] != "cudaMalloc"]
        if ours and peers:
            best = min(peers, key=lambda r: float(r["reserved_over_live"]))
            verdicts.append(verdict("%s, peak reserved over peak live" % trace,
                                    ours[0]["reserved_over_live"], best["allocator"],
                                    best["reserved_over_live"], "reserved/live",
                                    lower_is_better=True))
    return "\n".join(out) + "\n\n" + "\n\n".join(verdicts) + "\n"


def verdict(case, ours, peer, theirs, unit, lower_is_better):
    """A verdict line; within 1% of each other the two are on par (no winner named)."""
    advantage = float(theirs) / float(ours) if lower_is_better else float(ours) / float(theirs)
    better = advantage >= 1
    word = ", on par" if abs(advantage - 1) <= 0.01 else (" better" if better else " worse")
    return "Verdict %s: vram DevicePool %s %s vs best peer %s %s %s: **%.4gx%s**" % (
        case, raw(ours), unit, peer, raw(theirs), unit, advantage if better else 1 / advantage,
        word)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--scenario", help="only this scenario of a `vram bench` JSON")
    args = parser.parse_args()
    with open(args.json) as f:
        # Numbers stay the text the tool wrote, so a table shows them unrounded.
        data = json.load(f, parse_float=str, parse_int=str)
    if data.get("tool") == "vram bench":
        sys.stdout.write(bench_markdown(data, args.scenario))
    elif data.get("tool") == "vram replay":
        sys.stdout.write(replay_markdown(data))
    else:
        sys.exit("%s: neither `vram bench` nor `vram replay` JSON" % args.json)


if __name__ == "__main__":
    main()
