"""Resident memory of a command over time, split into anonymous and file-backed pages (/proc/PID/status), with the
peak of each phase: `loading` until the log shows --mark-run, `running` after it (bench/results/NOTES.md: where
the PPO stage of `make real-check` peaks above the doctor's plan).

    .venv/bin/python bench/probes/rss_trace.py --mark-run "ppo: " -- .venv/bin/rlhf ppo recipe=qwen3-0.6b ...

Prints one JSON line: the exit code and, per phase, VmRSS / RssAnon / RssFile (MiB) at that phase's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def status(pid: int) -> dict:
    keys = ("VmRSS", "RssAnon", "RssFile")
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f) if k in keys}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mark-run", required=True, help="log text that ends the loading phase")
    ap.add_argument("--interval", type=float, default=0.1)
    a = ap.parse_args(argv[:cut])
    if not argv[cut + 1:]:
        ap.error("give the command to trace after --")
    peaks: dict[str, dict] = {}
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen(argv[cut + 1:], stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            try:
                st = status(proc.pid)
            except (OSError, ValueError):
                break
            with open(log.name) as f:
                phase = "running" if a.mark_run in f.read() else "loading"
            if st.get("VmRSS", 0) > peaks.get(phase, {}).get("VmRSS", -1):
                peaks[phase] = st
            time.sleep(a.interval)
        rc = proc.wait()
    print(json.dumps({"rc": rc, "peaks_mib": peaks}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
