"""Time of a linear layer over a few rows as F.linear (x·Wᵀ) and as W·xᵀ, for the sampling loop's `weight_first`
rules (rlhf_cli/accel/); with --onednn, F.linear against oneDNN's linear (rlhf_cli.accel.cpu_linear) in fp32,
forward and both backward products, over the update's row counts.

    .venv/bin/python bench/probes/linear_probe.py [--dtypes float32 bfloat16]
    .venv/bin/python bench/probes/linear_probe.py --onednn

Prints, per weight shape and row count, time(F.linear) / time(the other): above 1, the other is faster. Shapes:
Qwen3-0.6B's linear layers (rows 2-16: its sampling batch) and the bench's mid and small workloads (rows 8-64);
best of 3 timings, 1 thread. Figures measured with it: bench/results/NOTES.md.
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
    ap.add_argument("--onednn", action="store_true", help="F.linear against oneDNN (fp32, forward and backward)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    if a.onednn:
        onednn(torch)
        return
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


def onednn(torch) -> None:
    """fp32 F.linear (and the two backward products as torch.mm) against oneDNN's, per shape and row count."""
    from rlhf_cli.accel.cpu_linear import _mm_t, available

    if not available():
        raise SystemExit("this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    shapes = sorted({s for shapes, _ in SHAPES.values() for s in shapes})
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f)
        cells = []
        for rows in (1, 8, 32, 256, 1024):
            if rows * out_f * in_f > 2**31:
                continue
            x, gy = torch.randn(rows, in_f), torch.randn(rows, out_f)
            n = max(2, int(2e8 / (rows * w.numel())))
            pairs = {
                "y": (lambda: torch.nn.functional.linear(x, w), lambda: _mm_t(x, w)),
                "gx": (lambda: torch.mm(gy, w), lambda: _mm_t(gy, w.t())),
                "gw": (lambda: torch.mm(gy.t(), x), lambda: _mm_t(gy.t(), x.t())),
            }
            ratios = [best_of(blas, n) / best_of(dnn, n) for blas, dnn in pairs.values()]
            cells.append(f"{rows} rows " + "/".join(f"{r:.2f}" for r in ratios))
        print(f"float32 {out_f}x{in_f} (y/gx/gw): " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
