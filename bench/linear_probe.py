"""Time of a linear layer over a few rows as F.linear (x·Wᵀ) and as W·xᵀ, for rlhf_cli.ppo.rollout.weight_first.

    .venv/bin/python bench/linear_probe.py [--dtypes float32 bfloat16]

Prints, per weight shape and row count, time(F.linear) / time(W·xᵀ): above 1, W·xᵀ is faster. Shapes: Qwen3-0.6B's
linear layers (rows 2-16: its sampling batch) and the bench's mid and small workloads (rows 8-64); best of 3
timings, 1 thread.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {
    "real": ([(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072), (151936, 1024)], (2, 4, 8, 16)),
    "mid": ([(256, 256), (128, 256), (768, 256), (256, 768), (1500, 256)], (8, 16, 32, 64)),
    "small": ([(512, 512), (256, 512), (1536, 512), (512, 1536)], (8, 16, 32, 64)),
}


def best_of(f, n: int, reps: int = 3) -> float:
    f(), f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    for dt in a.dtypes:
        dtype = getattr(torch, dt)
        for name, (shapes, row_counts) in SHAPES.items():
            for out_f, in_f in shapes:
                w = torch.randn(out_f, in_f, dtype=dtype)
                cells = []
                for rows in row_counts:
                    x = torch.randn(rows, in_f, dtype=dtype)
                    n = max(3, int(2e7 / w.numel()))
                    plain = best_of(lambda: torch.nn.functional.linear(x, w), n)
                    first = best_of(lambda: torch.mm(w, x.t()).t(), n)
                    cells.append(f"{rows} rows {plain / first:.2f}")
                print(f"{dt} {name} {out_f}x{in_f}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
