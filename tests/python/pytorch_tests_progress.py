"""A pytest plugin loaded by run_pytorch_tests.py for both allocators: each test's outcome is
appended to $VRAM_TESTS_PROGRESS as the test ends (so a process that aborts keeps what it
ran), the tests named in $VRAM_TESTS_DONE (run by an earlier process of the same suite) are
deselected, and the process stops at the first test after which the device is unusable for
the tests behind it (a stream left capturing, a sticky CUDA error), naming that test. The
runner then starts a new process for the rest. Changes no test's behaviour."""
import json
import os

# Recorded as the event of a test after which the device could not synchronize.
LEFT_DEVICE_UNUSABLE = "left_device_unusable"


def _record(entry):
    path = os.environ.get("VRAM_TESTS_PROGRESS")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("VRAM_TESTS_DONE")
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        done = {line.strip() for line in f if line.strip()}
    kept, dropped = [], []
    for item in items:
        (dropped if item.nodeid in done else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_collectionfinish(config, items):
    # The tests this process will run: after every deselection (-k, the done file).
    _record({"event": "collected", "tests": [item.nodeid for item in items]})
    return []


def pytest_unconfigure(config):
    _record({"event": "end"})


def pytest_runtest_logstart(nodeid, location):
    _record({"test": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    _record({"test": report.nodeid, "event": "phase", "when": report.when,
             "outcome": report.outcome})


def _device_unusable():
    """The first line of the error a device-wide synchronize raises now, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any error means the tests behind it cannot run
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def pytest_runtest_logfinish(nodeid, location):
    _record({"test": nodeid, "event": "finish"})
    message = _device_unusable()
    if message is not None:
        _record({"test": nodeid, "event": LEFT_DEVICE_UNUSABLE, "message": message})
        import pytest

        pytest.exit(f"the device is unusable after {nodeid}: {message}", returncode=7)


class Progress:
    """What one process recorded: `outcomes` {nodeid: passed|failed|error|skipped|crashed},
    `unusable` [(nodeid, message)] of tests after which the device could not synchronize
    (scored error: the test broke the process for the tests behind it), `collected` (the
    node ids the process was to run, None if it never got that far) and `reached_end`
    (pytest reached its end rather than the process dying). A test started and never finished
    is crashed: the process ended in it (or was interrupted, which the caller knows)."""

    def __init__(self, lines):
        phases, started, finished = {}, [], set()
        self.unusable, self.collected, self.reached_end = [], None, False
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short by the process's end
                continue
            test, event = entry.get("test"), entry.get("event")
            if event == "collected":
                self.collected = list(entry.get("tests", []))
            elif event == "end":
                self.reached_end = True
            elif event == "start":
                started.append(test)
            elif event == "finish":
                finished.add(test)
            elif event == "phase":
                phases.setdefault(test, []).append(entry)
            elif event == LEFT_DEVICE_UNUSABLE:
                self.unusable.append((test, entry.get("message", "")))
        self.outcomes = {}
        for test in started:
            reports = phases.get(test, [])
            if test not in finished:
                self.outcomes[test] = "crashed"
            elif any(r["outcome"] == "failed" and r["when"] == "call" for r in reports):
                self.outcomes[test] = "failed"
            elif any(r["outcome"] == "failed" for r in reports):
                self.outcomes[test] = "error"
            elif any(r["outcome"] == "skipped" for r in reports):
                self.outcomes[test] = "skipped"
            elif any(r["when"] == "call" and r["outcome"] == "passed" for r in reports):
                self.outcomes[test] = "passed"
            else:
                self.outcomes[test] = "crashed"
        for test, _ in self.unusable:
            if self.outcomes.get(test) != "failed":
                self.outcomes[test] = "error"
