"""Resident-set sampling for the two benchmark sides (imported by bench/rlhf_side.py and bench/trl_side.py, which
run in different environments; this module needs nothing beyond the standard library).

VmHWM (the kernel's peak) says how high a process went but not when. `RssSampler` reads VmRSS every
`interval` seconds in a daemon thread, so the report can say in which phase (model loading, generation, scoring,
the PPO epochs of update k) each side reached its peak. Samples can miss a peak that lasts less than the
interval; VmHWM stays the figure that is compared.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def memory_status() -> dict:
    """VmHWM (peak RSS), RssAnon and RssFile of this process now, in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmHWM", "RssAnon", "RssFile"):
            out[key] = round(int(line.split()[1]) / 1024.0, 1)
    return out


class RssSampler(threading.Thread):
    def __init__(self, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter, MB)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.perf_counter(), rss_mb()))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)

    def peak_phase(self, phases: list[tuple[str, float, float]]) -> dict:
        """The highest sample and the phase (name, start, end) it fell in; phases are perf_counter intervals."""
        if not self.samples:
            return {}
        t, mb = max(self.samples, key=lambda s: s[1])
        name = next((p for p, a, b in phases if a <= t < b), "outside the phases")
        return {"sampled_peak_mb": round(mb, 1), "phase": name}

    def phase_peaks(self, phases: list[tuple[str, float, float]]) -> dict[str, float]:
        """Highest sample per phase name (phases with the same name pooled)."""
        out: dict[str, float] = {}
        for p, a, b in phases:
            xs = [mb for t, mb in self.samples if a <= t < b]
            if xs:
                out[p] = round(max(out.get(p, 0.0), max(xs)), 1)
        return out
