"""A pytest plugin that records each test's CPU time (the worker's own and its waited-for children's, getrusage)
and wall time, one JSON line per test, for finding where the suite's time goes (bench/results/NOTES.md, issue 40).

    PYTHONPATH=bench/probes PYTEST_PLUGINS=cpu_per_test TEST_CPU_OUT=/tmp/test-cpu make test
    python bench/probes/cpu_per_test.py /tmp/test-cpu        -> CPU and wall seconds by test file, the costliest first

Processes a test kills (SIGKILL) and does not wait for are not counted: their CPU goes to nobody's getrusage.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

_out = None


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _out
    if _out is None:
        folder = Path(os.environ.get("TEST_CPU_OUT", "test-cpu"))
        folder.mkdir(parents=True, exist_ok=True)
        _out = open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
    cpu, wall = _cpu(), time.time()
    yield
    _out.write(json.dumps({"id": item.nodeid, "cpu": round(_cpu() - cpu, 2), "wall": round(time.time() - wall, 2)})
               + "\n")
    _out.flush()


def main(folder: str) -> None:
    cpu, wall = collections.Counter(), collections.Counter()
    for path in Path(folder).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            name = row["id"].split("::")[0]
            cpu[name] += row["cpu"]
            wall[name] += row["wall"]
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} CPU s {wall[name]:8.1f} wall s  {name}")
    print(f"{sum(cpu.values()):8.1f} CPU s {sum(wall.values()):8.1f} wall s  in all")


if __name__ == "__main__":
    main(sys.argv[1])
