"""torch's CPU exp against softmax on inputs shifted far below zero: why probabilities come from a softmax, not
from exp(log-probs), in rlhf's PPO (bench/results/NOTES.md: 77 vs 1,518 ms at (256, 151936)).

    .venv/bin/python bench/probes/exp_probe.py [--rows 256] [--vocab 151936] [--threads 1]

exp(x) is denormal for x below about -87 (fp32); the probe times both ops at a few offsets, median of 5 calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def ms(fn, x, reps: int = 5) -> float:
    fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    base = torch.randn(a.rows, a.vocab)
    print(f"({a.rows}, {a.vocab}) fp32, {a.threads} thread(s), median ms of 5 calls")
    for shift in (0, -50, -80, -100, -200):
        x = base + shift
        print(f"inputs near {shift:5d}: exp {ms(torch.exp, x):8.1f}  "
              f"softmax {ms(lambda z: torch.softmax(z, -1), x):8.1f}")


if __name__ == "__main__":
    main()
