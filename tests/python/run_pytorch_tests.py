"""Runs PyTorch's own CUDA tests twice, with PyTorch's allocator and with vram as
PyTorch's allocator (vram_enable_plugin.py), and compares the outcomes:

    python3 tests/python/run_pytorch_tests.py --tests DIR --out OUT [--only SUITE]

DIR holds PyTorch's test files of the installed version (test_cuda.py and
inductor/test_cudagraph_trees.py; they are not in PyTorch's wheel and not in this
repository). Every test that passes with PyTorch's allocator must pass under vram, except
those listed in pytorch_tests_exceptions.txt (beside this file) with their reason. Writes
OUT/pytorch_tests.json and .md; exit status 1 when a test regressed without a listed
reason (or a run could not start), 0 otherwise. A listed test that passes under vram is
reported as stale.
"""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

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


def outcomes(junit_path, suite):
    """{test id: passed|failed|error|skipped} from a junit XML file."""
    result = {}
    if not os.path.exists(junit_path):
        return result
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        test = f"{suite}::{cls}::{case.get('name')}"
        if case.find("failure") is not None:
            result[test] = "failed"
        elif case.find("error") is not None:
            result[test] = "error"
        elif case.find("skipped") is not None:
            result[test] = "skipped"
        else:
            result[test] = "passed"
    return result


def run_suite(python, tests_dir, out, name, path, expression, allocator, timeout):
    junit = os.path.join(out, f"{name}-{allocator}.xml")
    log = os.path.join(out, f"{name}-{allocator}.log")
    env = dict(os.environ)
    # Each run builds the tests' C++ extensions in its own folder: two runs at once sharing
    # PyTorch's default folder wait on each other's build lock.
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.abspath(out), f"extensions-{name}-{allocator}")
    tests_dir = os.path.abspath(tests_dir)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python"), HERE, os.path.join(tests_dir, os.path.dirname(path)),
         tests_dir, env.get("PYTHONPATH", "")])
    cmd = [python, "-m", "pytest", os.path.join(tests_dir, path), "-k", expression, "-q",
           "-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "pytorch_tests_compat", "--junitxml", junit,
           "-o", "junit_family=xunit1", "-rfE"]
    if allocator == "vram":
        cmd[3:3] = ["-p", "vram_enable_plugin"]
    try:
        import pytest_timeout  # noqa: F401

        cmd += ["--timeout", "90"]
    except ImportError:
        pass
    start = time.time()
    with open(log, "w") as f:
        # At the time limit pytest gets SIGINT: it stops and still writes the junit file with
        # the tests it ran, so a run cut short reports what it saw (rc "interrupted").
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tests_dir,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "interrupted"
    return outcomes(junit, name), rc, time.time() - start


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
        torch_res, torch_rc, torch_s = runs[(name, "torch")]
        vram_res, vram_rc, vram_s = runs[(name, "vram")]
        for allocator, res, rc in (("torch", torch_res, torch_rc), ("vram", vram_res, vram_rc)):
            if not res:
                report["failed_runs"].append(f"{name} ({allocator}): no results, rc {rc}")
        counts = {}
        for allocator, res in (("torch", torch_res), ("vram", vram_res)):
            counts[allocator] = {k: sum(1 for v in res.values() if v == k)
                                 for k in ("passed", "failed", "error", "skipped")}
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
        report["suites"][name] = {"torch": counts["torch"], "vram": counts["vram"],
                                  "pass_with_both": both, "torch_rc": torch_rc,
                                  "vram_rc": vram_rc, "torch_s": round(torch_s, 1),
                                  "vram_s": round(vram_s, 1)}
    with open(os.path.join(args.out, "pytorch_tests.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = ["| suite | PyTorch's allocator: pass/fail/error/skip | vram | pass with both | "
             "exit (PyTorch's / vram) | seconds |", "|---|---|---|---|---|---|"]
    for name, s in report["suites"].items():
        t, v = s["torch"], s["vram"]
        lines.append(f"| {name} | {t['passed']}/{t['failed']}/{t['error']}/{t['skipped']} | "
                     f"{v['passed']}/{v['failed']}/{v['error']}/{v['skipped']} | "
                     f"{s['pass_with_both']} | {s['torch_rc']} / {s['vram_rc']} | "
                     f"{s['torch_s']} / {s['vram_s']} |")
    lines.append("")
    lines.append(f"regressions without a listed reason: {len(report['regressions'])}")
    lines += [f"- {r['test']} ({r['vram']} under vram)" for r in report["regressions"]]
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
