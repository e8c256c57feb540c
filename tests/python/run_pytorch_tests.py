"""Runs PyTorch's own CUDA tests twice, with PyTorch's allocator and with vram as
PyTorch's allocator (vram_enable_plugin.py), and compares the outcomes:

    python3 tests/python/run_pytorch_tests.py --tests DIR --out OUT [--only SUITE]

DIR holds PyTorch's test files of the installed version (test_cuda.py and
inductor/test_cudagraph_trees.py; they are not in PyTorch's wheel and not in this
repository). Every test that passes with PyTorch's allocator must pass under vram, except
those listed in pytorch_tests_exceptions.txt (beside this file) with their reason. Writes
OUT/pytorch_tests.json and .md; exit status 1 when a test regressed without a listed
reason (or a run could not start), 0 otherwise. A listed test that passes under vram is
reported as stale. A suite runs in as many processes as it takes: after a test that leaves
the device unusable (scored error) or one the process crashes in (scored crashed), or when a
process ends before pytest's end, a new process runs the tests not run yet
(pytorch_tests_progress.py); the report names those tests and any test never run. Each
regression is then run again alone, in a fresh process per allocator: the report says whether
it fails under vram by itself or only after the tests before it in the same process (it stays
a regression either way).
"""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import pytorch_tests_progress

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (name, file under DIR, pytest -k expression): the tests of the allocator's concerns, each
# file in one process (pytest-xdist workers would import Torch and Inductor again each, which
# on a fresh machine took longer than the tests).
SUITES = [
    ("test_cuda",
     "test_cuda.py",
     "(memory or Memory or graph or Graph or stream or Stream or pool or Pool or alloc or "
     "Alloc or oom or OOM or snapshot or fraction or cach or empty or record or stats or "
     "peak or ipc or IPC) and not expandable"),
    ("cudagraph_trees",
     os.path.join("inductor", "test_cudagraph_trees.py"),
     "CudaGraphTreeTests"),
]


def read_exceptions(path):
    """{test id: reason} from lines `file::Class::test  reason`; # starts a comment."""
    listed = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            test, _, reason = line.partition(" ")
            reason = reason.strip()
            if not reason:
                raise SystemExit(f"{path}: {test} has no reason")
            listed[test] = reason
    return listed


def test_id(suite, nodeid):
    """`suite::Class::test` from a pytest node id `path/file.py::Class::test`."""
    return f"{suite}::{nodeid.split('::', 1)[1]}" if "::" in nodeid else f"{suite}::{nodeid}"


# A process that stopped because a test left the device unusable, or that ended before pytest's
# end, is followed by another for the tests not run yet, at most this many times per suite and
# allocator, and only while each process runs at least one more test.
MOST_PROCESSES = 12
# pytest's exit statuses of a run that reached its end: all passed, some failed, none
# collected (every test already run). 7: pytorch_tests_progress.py stopped it.
FINISHED_EXITS = (0, 1, 5)


def pytest_env(out, tests_dir, path, extensions):
    """The environment of one pytest process over `path` (under `tests_dir`, absolute): its own
    folder for the tests' C++ extensions (two runs at once sharing PyTorch's default folder
    wait on each other's build lock), vram's modules and the test file's folder importable."""
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.abspath(out), f"extensions-{extensions}")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python"), HERE, os.path.join(tests_dir, os.path.dirname(path)),
         tests_dir, env.get("PYTHONPATH", "")])
    env.pop("VRAM_TESTS_DONE", None)
    return env


def pytest_cmd(python, target, allocator, *options):
    """pytest over `target` with the plug-ins both allocators run with (vram's first, when it
    is the allocator), then `options`."""
    cmd = [python, "-m", "pytest", target, *options, "-q", "-p", "no:cacheprovider",
           "-p", "no:benchmark", "-p", "pytorch_tests_compat", "-p", "pytorch_tests_progress",
           "-rfE"]
    if allocator == "vram":
        cmd[3:3] = ["-p", "vram_enable_plugin"]
    return cmd


def read_progress(path):
    """pytorch_tests_progress's record of one process (empty when it wrote none)."""
    if not os.path.exists(path):
        return pytorch_tests_progress.Progress([])
    with open(path, encoding="utf-8") as p:
        return pytorch_tests_progress.Progress(p.readlines())


def run_suite(python, tests_dir, out, name, path, expression, allocator, timeout):
    """Runs the suite with `allocator` in as many processes as it takes (see MOST_PROCESSES):
    the next process runs the tests that the first collected and none has run yet. Returns
    ({test id: outcome}, rc, seconds, events); rc is the last process's exit status, or
    "interrupted" when the time limit or the process limit left tests not run; events:
    {"left_device_unusable": [(test, message)], "crashed": [test], "not_run": [test],
    "processes": n}."""
    log = os.path.join(out, f"{name}-{allocator}.log")
    done_path = os.path.join(out, f"{name}-{allocator}.done")
    tests_dir = os.path.abspath(tests_dir)
    env = pytest_env(out, tests_dir, path, f"{name}-{allocator}")
    env["VRAM_TESTS_DONE"] = done_path
    result = {}
    events = {"left_device_unusable": [], "crashed": [], "not_run": [], "processes": 0}
    expected, done = set(), []
    rc = None
    start = time.time()
    with open(log, "w") as f:
        while True:
            left = timeout - (time.time() - start)
            if left <= 5 or events["processes"] == MOST_PROCESSES:
                rc = "interrupted"  # a limit, with tests left (checked below)
                break
            n = events["processes"] = events["processes"] + 1
            progress = os.path.join(out, f"{name}-{allocator}.progress{n}")
            junit = os.path.join(out, f"{name}-{allocator}-{n}.xml")
            for stale in (progress, junit):  # an earlier run into the same folder
                if os.path.exists(stale):
                    os.remove(stale)
            with open(done_path, "w", encoding="utf-8") as d:
                d.write("".join(t + "\n" for t in done))
            env["VRAM_TESTS_PROGRESS"] = progress
            cmd = pytest_cmd(python, os.path.join(tests_dir, path), allocator, "-k", expression,
                             "--junitxml", junit, "-o", "junit_family=xunit1")
            try:
                import pytest_timeout  # noqa: F401

                cmd += ["--timeout", "90"]
            except ImportError:
                pass
            f.write(f"==== process {n}: {' '.join(cmd)}\n")
            f.flush()
            # At the time limit pytest gets SIGINT: it stops; the test it was in is not counted.
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=tests_dir, start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = "interrupted"
            ran = read_progress(progress)
            if ran.collected is not None:
                expected.update(ran.collected)
            for nodeid, outcome in ran.outcomes.items():
                if outcome == "crashed" and rc == "interrupted":
                    continue  # cut short by the time limit: neither run nor failed
                result[test_id(name, nodeid)] = outcome
                done.append(nodeid)
                if outcome == "crashed":
                    events["crashed"].append(test_id(name, nodeid))
            events["left_device_unusable"] += [(test_id(name, t), m) for t, m in ran.unusable]
            if rc == "interrupted":
                break
            finished = ran.reached_end and rc in FINISHED_EXITS and not ran.unusable
            if finished or not expected.difference(done) or not ran.outcomes:
                break  # the end, nothing left, or a process that ran no test (no progress)
    events["not_run"] = sorted(test_id(name, t) for t in expected.difference(done))
    return result, rc, time.time() - start, events


# Regressions run again alone (each in a fresh process per allocator), at most this many per
# call, each process at most ALONE_SECONDS.
MOST_ALONE = 24
ALONE_SECONDS = 240


def run_alone(python, tests_dir, out, name, path, test, allocator):
    """Runs suite `name`'s test `test` (`suite::Class::test`) alone with `allocator` in a fresh
    process; its outcome ("passed", "failed", ..., "crashed", or "not run" when pytest ran
    nothing)."""
    tests_dir = os.path.abspath(tests_dir)
    tail = test.split("::", 1)[1]
    slug = tail.replace("::", "-")
    progress = os.path.join(out, f"alone-{name}-{slug}-{allocator}.progress")
    if os.path.exists(progress):
        os.remove(progress)
    env = pytest_env(out, tests_dir, path, f"alone-{allocator}")
    env["VRAM_TESTS_PROGRESS"] = progress
    cmd = pytest_cmd(python, f"{path}::{tail}", allocator)
    log = os.path.join(out, f"alone-{name}-{slug}-{allocator}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tests_dir,
                                start_new_session=True)
        try:
            proc.wait(timeout=ALONE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return next(iter(read_progress(progress).outcomes.values()), "not run")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", required=True, help="folder of PyTorch's test files")
    parser.add_argument("--out", required=True)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--only", action="append", help="suite name(s) to run")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per suite run; then it is interrupted, its results kept")
    parser.add_argument("--together", action="store_true",
                        help="run each suite with both allocators at once (two processes on "
                        "one GPU: half the time; a test that measures the whole GPU may differ)")
    parser.add_argument("--wait-for", help="a file to wait for before the runs under vram "
                        "(the plug-in built beside the runs with PyTorch's allocator)")
    parser.add_argument("--no-alone", action="store_true",
                        help="do not run the regressions again alone")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    listed = read_exceptions(os.path.join(HERE, "pytorch_tests_exceptions.txt"))
    report = {"suites": {}, "regressions": [], "excused": [], "stale": [], "not_reached": [],
              "failed_runs": []}
    runs = {}  # (suite, allocator): (outcomes, rc, seconds)
    suites = []
    for name, path, expression in SUITES:
        if args.only and name not in args.only:
            continue
        if not os.path.exists(os.path.join(args.tests, path)):
            report["failed_runs"].append(f"{name}: {path} not found in {args.tests}")
            continue
        suites.append((name, path, expression))

    def run(name, path, expression, allocator):
        if allocator == "vram" and args.wait_for:
            while not os.path.exists(args.wait_for):
                time.sleep(1)
        runs[(name, allocator)] = run_suite(args.python, args.tests, args.out, name, path,
                                            expression, allocator, args.timeout)

    if args.together:
        for suite in suites:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(run, *suite, a) for a in ("torch", "vram")]:
                    f.result()
    else:  # PyTorch's allocator first: its runs need no plug-in
        for allocator in ("torch", "vram"):
            for suite in suites:
                run(*suite, allocator)
    for name, path, expression in SUITES:
        if (name, "torch") not in runs:
            continue
        torch_res, torch_rc, torch_s, torch_events = runs[(name, "torch")]
        vram_res, vram_rc, vram_s, vram_events = runs[(name, "vram")]
        for allocator, res, rc, ev in (("torch", torch_res, torch_rc, torch_events),
                                       ("vram", vram_res, vram_rc, vram_events)):
            if not res:
                report["failed_runs"].append(f"{name} ({allocator}): no results, rc {rc}")
            elif ev["not_run"] and rc != "interrupted":
                report["failed_runs"].append(
                    f"{name} ({allocator}): {len(ev['not_run'])} tests never ran (the last of "
                    f"{ev['processes']} processes ended with rc {rc} and ran no test)")
        counts = {}
        for allocator, res in (("torch", torch_res), ("vram", vram_res)):
            counts[allocator] = {k: sum(1 for v in res.values() if v == k)
                                 for k in ("passed", "failed", "error", "skipped", "crashed")}
        both = 0
        for test, outcome in sorted(torch_res.items()):
            if outcome != "passed":
                continue
            under_vram = vram_res.get(test, "missing")
            if under_vram == "passed":
                both += 1
                if test in listed:
                    report["stale"].append(test)
            elif under_vram == "missing" and vram_rc == "interrupted":
                report["not_reached"].append(test)
            elif test in listed:
                report["excused"].append({"test": test, "vram": under_vram,
                                          "reason": listed[test]})
            else:
                report["regressions"].append({"test": test, "vram": under_vram})
        if not args.no_alone:  # each regression of this suite again, alone (MOST_ALONE)
            rerun = sum(1 for r in report["regressions"] if "alone" in r)
            for r in [r for r in report["regressions"] if r["test"].startswith(name + "::")]:
                if rerun == MOST_ALONE:
                    break
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    futures = {a: pool.submit(run_alone, args.python, args.tests, args.out, name,
                                              path, r["test"], a) for a in ("torch", "vram")}
                    r["alone"] = {a: f.result() for a, f in futures.items()}
                rerun += 1
        report["suites"][name] = {"torch": counts["torch"], "vram": counts["vram"],
                                  "pass_with_both": both, "torch_rc": torch_rc,
                                  "vram_rc": vram_rc, "torch_s": round(torch_s, 1),
                                  "vram_s": round(vram_s, 1), "torch_events": torch_events,
                                  "vram_events": vram_events,
                                  "torch_outcomes": torch_res, "vram_outcomes": vram_res}
    with open(os.path.join(args.out, "pytorch_tests.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = ["| suite | PyTorch's allocator: pass/fail/error/skip/crashed | vram | pass with both | "
             "processes (PyTorch's / vram) | exit of the last | seconds |",
             "|---|---|---|---|---|---|---|"]
    for name, s in report["suites"].items():
        t, v = s["torch"], s["vram"]
        lines.append(f"| {name} | {t['passed']}/{t['failed']}/{t['error']}/{t['skipped']}/"
                     f"{t['crashed']} | {v['passed']}/{v['failed']}/{v['error']}/{v['skipped']}/"
                     f"{v['crashed']} | {s['pass_with_both']} | "
                     f"{s['torch_events']['processes']} / {s['vram_events']['processes']} | "
                     f"{s['torch_rc']} / {s['vram_rc']} | {s['torch_s']} / {s['vram_s']} |")
    lines.append("")
    for name, s in report["suites"].items():
        for allocator in ("torch", "vram"):
            e = s[f"{allocator}_events"]
            who = "PyTorch's allocator" if allocator == "torch" else "vram"
            lines += [f"- {name}, {who}: the device was unusable after {t} ({m}); scored "
                      f"error, the rest left to a new process" for t, m in e["left_device_unusable"]]
            lines += [f"- {name}, {who}: the process ended in {t} (crashed); the rest left to "
                      f"a new process" for t in e["crashed"]]
            if e["not_run"]:
                lines.append(f"- {name}, {who}: {len(e['not_run'])} tests not run")
    lines.append("")
    lines.append(f"regressions without a listed reason: {len(report['regressions'])}")
    for r in report["regressions"]:
        line = f"- {r['test']} ({r['vram']} under vram)"
        if "alone" in r:
            a = r["alone"]
            line += (f"; alone in a fresh process: {a['torch']} with PyTorch's allocator, "
                     f"{a['vram']} under vram")
            if a["vram"] == "passed":
                line += " (fails only after the tests before it)"
        lines.append(line)
    lines.append(f"listed exceptions that differ: {len(report['excused'])}")
    lines += [f"- {r['test']}: {r['reason']}" for r in report["excused"]]
    if report["stale"]:
        lines.append(f"listed but passing under vram (stale): {len(report['stale'])}")
        lines += [f"- {t}" for t in report["stale"]]
    if report["not_reached"]:
        lines.append(f"passed with PyTorch's allocator, not reached under vram before the "
                     f"time limit: {len(report['not_reached'])}")
    lines += [f"run failed: {r}" for r in report["failed_runs"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "pytorch_tests.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if report["regressions"] or report["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
