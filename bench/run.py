"""PPO benchmark: rlhf's PPO stage against TRL 1.12's PPOTrainer, side by side (`make bench`).

    .venv/bin/python bench/run.py            # tiny, mini, mid, midsmall, small (about 70 min on a quiet 2-core box,
                                             # 1 thread)
    .venv/bin/python bench/run.py --quick    # smoke run: 1 repetition, few updates, results in bench/work/
    .venv/bin/python bench/run.py --only speed --workloads tiny --reps 5
    .venv/bin/python bench/run.py --real     # `make bench-real`: Qwen3-0.6B's shape, LoRA, fp32 and bf16
                                             # (bf16 only on CPUs with bf16 units)
    .venv/bin/python bench/run.py --report-only   # rebuild bench/results/README.md from the JSON files

What it does, in order:
  1. bench/setup_trl_env.sh: bench/.venv-trl112 with trl==1.12.0 (once); bench/setup_rlhf_env.sh:
     bench/.venv-rlhf, a private copy of .venv that the rlhf side runs from (see that script for why).
  2. bench/workload.py: the workloads in bench/work/ (once; deterministic).
  3. speed: for each workload and variant (lora, full), repetitions of TRL, TRL without its forced
     gc.collect() calls (--no-gc), and rlhf, alternating (A B C A B C ...), each run in its own process with
     the same torch thread count. Settings are fixed by bench/trl_side.py and bench/rlhf_side.py.
     --real instead runs the real workload (LoRA; fp32, then bf16; TRL and rlhf alternating) into real.json.
  4. roofline: the fp32 matmul rate of this machine at that thread count (torch.matmul on square matrices),
     and the achieved GFLOP/s of a PPO update on the small workload for both sides.
  5. learning: bench/learning.py (demo task, equal episodes, both sides; RM score gain and polite rate).
  6. bench/results/{speed,roofline,learning}.json and bench/results/README.md (the tables; the prose that
     explains them is the hand-written bench/results/NOTES.md, which this script never writes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = REPO / ".venv" / "bin" / "python"
RLHF_PY = HERE / ".venv-rlhf" / "bin" / "python"  # private copy of .venv (bench/setup_rlhf_env.sh)
TRL_PY = HERE / ".venv-trl112" / "bin" / "python"
EPISODES_PER_UPDATE = 32
PPO_EPOCHS = 2

FULL = {"tiny": {"updates": 8, "response_length": 32}, "mini": {"updates": 8, "response_length": 32},
        "mid": {"updates": 4, "response_length": 64}, "small": {"updates": 4, "response_length": 64},
        "midsmall": {"updates": 4, "response_length": 48}}
QUICK = {"tiny": {"updates": 2, "response_length": 32}, "mini": {"updates": 2, "response_length": 32},
         "mid": {"updates": 1, "response_length": 64}, "small": {"updates": 1, "response_length": 64},
         "midsmall": {"updates": 1, "response_length": 48}}
# the real workload: 8 episodes per update (micro-batch 2 x accumulation 4, rollout batch 8), 2 updates x 32 tokens
REAL = {"updates": 2, "response_length": 32, "episodes_per_update": 8, "micro_batch": 2}
QUICK_REAL = {"updates": 1, "response_length": 4, "episodes_per_update": 2, "micro_batch": 1}
BETWEEN = ("mini", "mid", "midsmall")  # the sizes between tiny and small
SIDES = {"trl": "TRL 1.12", "trl_nogc": "TRL 1.12, gc off", "rlhf": "rlhf"}


def side_name(key: str) -> str:
    """A side's label; a results file from another version of the benchmark may hold sides this one no longer
    runs, and the report still names them."""
    return SIDES.get(key, key)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_for(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1")


def run_cmd(cmd: list, logfile: Path, threads: int, timeout: float | None = None) -> None:
    with open(logfile, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        r = subprocess.run([str(c) for c in cmd], cwd=str(REPO), env=env_for(threads), stdout=f,
                           stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"failed ({r.returncode}): {' '.join(map(str, cmd))}; see {logfile}")


# ------------------------------------------------------------------------------------------------ setup
def setup(work: Path, workloads: list[str], logfile: Path, need_trl: bool) -> None:
    if need_trl:
        log("TRL 1.12 environment (bench/setup_trl_env.sh)")
        run_cmd(["bash", HERE / "setup_trl_env.sh"], logfile, 1)
    log("rlhf environment copy (bench/setup_rlhf_env.sh)")
    run_cmd(["bash", HERE / "setup_rlhf_env.sh"], logfile, 1)
    for name in workloads:
        log(f"workload {name}")
        run_cmd([PY, HERE / "workload.py", name, work / name], logfile, 1)


def settle_page_cache() -> str:
    """Peak RSS counts the library files a process maps. Files written moments ago (a fresh venv) sit in the page
    cache in large blocks that a page fault maps whole, which inflated one side's peak RSS by ~85 MB in a
    fresh clone (`import torch` alone: 267 vs 219 MB) depending on which venv was installed last. Dropping the
    clean page cache first makes both sides map their libraries the same way. Needs root; otherwise the report
    says it was not done."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "dropped"
    except OSError as e:
        return f"not dropped ({e.strerror or e})"


# ------------------------------------------------------------------------------------------------ speed
def one_run(side: str, wl: str, variant: str, shape: dict, threads: int, raw: Path, rep: int, logfile: Path,
            precision: str = "fp32") -> dict:
    tag = "" if precision == "fp32" else f"_{precision}"
    out = raw / f"{wl}_{variant}{tag}_{side}_r{rep}.json"
    common = ["--workload-dir", raw.parent / wl, "--variant", variant, "--updates", shape["updates"],
              "--response-length", shape["response_length"], "--threads", threads, "--precision", precision,
              "--out", out]
    if "episodes_per_update" in shape:
        common += ["--episodes-per-update", shape["episodes_per_update"], "--micro-batch", shape["micro_batch"]]
    if side == "rlhf":
        cmd = [RLHF_PY, HERE / "rlhf_side.py", *common]
    else:
        cmd = [TRL_PY, HERE / "trl_side.py", *common, *(["--no-gc"] if side == "trl_nogc" else [])]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    run_cmd(cmd, logfile, threads)
    res = json.loads(out.read_text())
    res.setdefault("precision", precision)
    res.update({"side_key": side, "rep": rep, "process_s": round(time.perf_counter() - t0, 2),
                "loadavg_before": round(load0, 2), "loadavg_after": round(os.getloadavg()[0], 2)})
    return res


def stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


SPLIT_KEYS = ("generate_s", "score_s", "train_s", "other_s")


def split_stats(rs: list[dict]) -> dict | None:
    """Median seconds per update of each phase over the runs (every update of every run pooled)."""
    if not all(r.get("split_s") for r in rs):
        return None
    return {k: round(statistics.median([x for r in rs for x in r["split_s"].get(k, [])]), 4)
            for k in SPLIT_KEYS if all(r["split_s"].get(k) for r in rs)}


def group_key(r: dict) -> tuple:
    return r["workload"], r["variant"], r.get("precision", "fp32")


def eps_of(r: dict) -> float:
    """Episodes per second of one run from its counts: the sides' own `eps` field is rounded to 3 decimals,
    1.6% of the real workload's 0.03 episodes/s."""
    return r["episodes"] / r["train_s"]


def summarise_speed(runs: list[dict]) -> dict:
    out = {}
    order = {w: i for i, w in enumerate(["tiny", "mini", "mid", "midsmall", "small", "real"])}
    for key in sorted({group_key(r) for r in runs}, key=lambda k: (order.get(k[0], 9), k[1], k[2] != "fp32")):
        group = [r for r in runs if group_key(r) == key]
        sides = {}
        for side in SIDES:
            rs = sorted((r for r in group if r["side_key"] == side), key=lambda r: r["rep"])
            if not rs:
                continue
            sides[side] = {
                "eps": stats([eps_of(r) for r in rs]),
                "tokens_per_s": stats([r["episodes"] * r["response_length"] / r["train_s"] for r in rs]),
                "s_per_update": stats([r["train_s"] / r["updates"] for r in rs]),
                "split_s_median": split_stats(rs),
                "rss_peak_phases": [r.get("rss_peak_phase", {}).get("phase") for r in rs],
                "precision_detail": rs[0].get("precision_detail"),
                "peak_rss_mb": stats([r["peak_rss_mb"] for r in rs]),
                "cpu_eps": stats([r["episodes"] / r["cpu_s"] if r.get("cpu_s") else None for r in rs]),
                "gc_s_per_update": stats([r["gc_s"] / r["updates"] for r in rs if r.get("gc_s") is not None])
                if side == "trl" else None,
                "loadavg_runs": [r["loadavg_before"] for r in rs],
                "eps_cv": round(statistics.pstdev([eps_of(r) for r in rs])
                                / statistics.mean([eps_of(r) for r in rs]), 3),
                "loadavg": stats([r["loadavg_before"] for r in rs]),
            }
        pairs = []
        for side in ("trl", "trl_nogc"):
            ours = {r["rep"]: r for r in group if r["side_key"] == "rlhf"}
            theirs = {r["rep"]: r for r in group if r["side_key"] == side}
            for rep in sorted(set(ours) & set(theirs)):
                a, b = ours[rep], theirs[rep]
                pairs.append({"rep": rep, "vs": side, "eps_ratio": round(eps_of(a) / eps_of(b), 3),
                              "rss_ratio": round(a["peak_rss_mb"] / b["peak_rss_mb"], 3),
                              "cpu_eps_ratio": round(b["cpu_s"] / a["cpu_s"], 3)
                              if a.get("cpu_s") and b.get("cpu_s") else None})
        ratios = {}
        for side in ("trl", "trl_nogc"):
            ps = [p for p in pairs if p["vs"] == side]
            if ps:
                ratios[side] = {"eps_ratio": stats([p["eps_ratio"] for p in ps]),
                                "rss_ratio": stats([p["rss_ratio"] for p in ps]),
                                "cpu_eps_ratio": stats([p["cpu_eps_ratio"] for p in ps]), "vs": side}
        name = f"{key[0]}/{key[1]}" + ("" if key[2] == "fp32" else f"/{key[2]}")
        out[name] = {"workload": key[0], "variant": key[1], "precision": key[2], "sides": sides, "pairs": pairs,
                     "ratios": ratios}
    return out


def speed(args, work: Path, shapes: dict, logfile: Path) -> list[dict]:
    raw = work / ("results-quick" if args.quick else "results")
    raw.mkdir(parents=True, exist_ok=True)
    runs = []
    for wl in args.workloads:
        for variant in args.variants:
            sides = ["trl", "trl_nogc", "rlhf"]
            for rep in range(args.rep_start, args.rep_start + args.reps):
                for side in sides:
                    r = one_run(side, wl, variant, shapes[wl], args.threads, raw, rep, logfile)
                    runs.append(r)
                    log(f"{wl:5s} {variant:4s} {side_name(side)[:17]:17s} rep {rep}: {eps_of(r):8.2f} eps/s, "
                        f"{r['train_s'] / r['updates']:7.3f} s/update, peak RSS {r['peak_rss_mb']:7.1f} MB "
                        f"(load {r['loadavg_before']:.1f})")
    return runs


def real(args, work: Path, logfile: Path) -> list[dict]:
    """The real workload: LoRA, each precision in turn, TRL and rlhf alternating (A B A B)."""
    raw = work / ("results-real-quick" if args.quick else "results-real")
    raw.mkdir(parents=True, exist_ok=True)
    shape = QUICK_REAL if args.quick else REAL
    runs = []
    mm = [matmul_rate(args.threads, d) for d in ("float32", "bfloat16")]
    log("matmul: " + ", ".join(f"{m['dtype']} {m['gflops']} GFLOP/s" for m in mm))
    skipped = {}
    why = bf16_unfit(mm)
    if why and "bf16" in args.precisions:
        skipped["bf16"] = why
        log(f"real bf16 not run: {why}")
    for precision in [p for p in args.precisions if p not in skipped]:
        for rep in range(args.rep_start, args.rep_start + args.reps):
            for side in args.sides:
                settle_page_cache()  # the previous run's 15 GB leave no trace in the next one's page faults
                r = one_run(side, "real", "lora", shape, args.threads, raw, rep, logfile, precision)
                runs.append(r)
                sp = r.get("split_s") or {}
                log(f"real {precision} {side_name(side):8s} rep {rep}: {eps_of(r):.4f} eps/s, "
                    f"{r['tokens_per_s']:.2f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MB, split "
                    + " ".join(f"{k[:-2]} {sum(v):.1f}" for k, v in sp.items())
                    + f" (load {r['loadavg_before']:.1f})")
    mm += [matmul_rate(args.threads, d) for d in ("float32", "bfloat16")]
    log("matmul: " + ", ".join(f"{m['dtype']} {m['gflops']} GFLOP/s" for m in mm[2:]))
    meta = json.loads((work / "real" / "workload.json").read_text())
    flops = real_flops(meta, mean_padded_prompt(work / "real", batch=shape["episodes_per_update"]),
                       shape["response_length"], shape["episodes_per_update"])
    return runs, {"matmul": mm, "flops": flops, "skipped": skipped}


BF16_MIN_SHARE = 0.25  # bf16 matmuls below this share of the fp32 rate: the CPU has no bf16 units


def bf16_unfit(mm: list[dict]) -> str | None:
    """Why the bf16 runs would not measure either side's PPO (None where they would): on a CPU without bf16 units
    (AVX2 only: no AVX512-BF16, no AMX) torch's bf16 matmuls run tens of times below the fp32 rate, so a bf16 run
    takes hours and times the missing hardware, not the implementation."""
    rate = {m["dtype"]: m["gflops"] for m in mm}
    f32, b16 = rate.get("float32"), rate.get("bfloat16")
    if not f32 or b16 is None or b16 >= BF16_MIN_SHARE * f32:
        return None
    return (f"this CPU has no bf16 matmul units: bf16 {b16:g} vs fp32 {f32:g} GFLOP/s at 1 thread "
            f"({f32 / b16:.0f}x slower), so a bf16 run would take hours and time the missing units; run "
            "`make bench-real` on a CPU with AVX512-BF16 or AMX for the bf16 pairs")


# --------------------------------------------------------------------------------------------- roofline
MATMUL_SCRIPT = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
out = {}
for n in (1024, 1536, 2048):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = time.perf_counter()
    torch.matmul(a, b)
    if out and time.perf_counter() - t > 1.0:
        break  # a dtype without matmul units here (bf16 on AVX2: ~1 GFLOP/s): the smaller sizes tell
    torch.matmul(a, b)
    best = []
    for _ in range(3):
        k, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            torch.matmul(a, b)
            k += 1
        best.append(2 * n ** 3 * k / (time.perf_counter() - t) / 1e9)
    out[str(n)] = round(max(best), 1)
print(json.dumps(out))
"""


def matmul_rate(threads: int, dtype: str = "float32") -> dict:
    r = subprocess.run([str(PY), "-c", MATMUL_SCRIPT, str(threads), dtype], env=env_for(threads),
                       capture_output=True, text=True, check=True)
    rates = json.loads(r.stdout.strip().splitlines()[-1])
    return {"by_size": rates, "gflops": max(rates.values()), "dtype": dtype, "loadavg": round(os.getloadavg()[0], 2)}


def mean_padded_prompt(wdir: Path, batch: int = EPISODES_PER_UPDATE, draws: int = 2000) -> float:
    """Expected padded prompt length of a batch: the longest of `batch` prompts drawn at random."""
    lens = [json.loads(line)["n_tokens"] for line in (wdir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    return sum(max(rng.sample(lens, batch)) for _ in range(draws)) / draws


def update_flops(meta: dict, P: float, R: int, variant: str, B: int = EPISODES_PER_UPDATE,
                 epochs: int = PPO_EPOCHS) -> dict:
    """Model FLOPs of one PPO update (see the README for the formula)."""
    s = meta["shape"]
    d, L, h, kv, hd, ff = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                           s["num_key_value_heads"], s["head_dim"], s["intermediate_size"])
    V = meta["vocab_size"]
    N = L * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff)  # matmul weights of the blocks
    head = d * V  # tied LM head, per position whose logits are computed
    T = B * (P + R)  # tokens of one forward over the batch (prompt padded to P)
    gen = 2 * N * B * (P + R - 1) + 2 * head * B * R
    score = 2 * N * T + 2 * head * B * R + 2 * N * T + 2 * N * T  # reference, value model, reward model
    train_conv = epochs * (6 * N * T + 6 * head * B * R + 6 * N * T)  # policy + value, fwd 2N + bwd 4N
    # LoRA: the frozen base needs no weight gradients, so the policy's backward is 2N (input gradients only)
    pol_bwd = 2 if variant == "lora" else 4
    train_exec = epochs * ((2 + pol_bwd) * (N * T + head * B * R) + 6 * N * T)
    return {"N_block_params": N, "lm_head_params": head, "P_mean": round(P, 2), "R": R, "B": B,
            "tokens_per_forward": round(T, 1), "gen_gflop": round(gen / 1e9, 2), "score_gflop": round(score / 1e9, 2),
            "train_gflop_6N": round(train_conv / 1e9, 2), "train_gflop_executed": round(train_exec / 1e9, 2),
            "update_gflop_6N": round((gen + score + train_conv) / 1e9, 2),
            "update_gflop_executed": round((gen + score + train_exec) / 1e9, 2)}


def real_flops(meta: dict, P: float, R: int, B: int, epochs: int = PPO_EPOCHS) -> dict:
    """Matmul FLOPs of one update of the real workload (LoRA policy, full value model), per side: TRL runs the LM
    head over every position of its reference and training forwards, rlhf over the R response positions only;
    rlhf in bf16 adds the recomputation of the old log-probs (one more policy forward)."""
    s = meta["shape"]
    d, L, h, kv, hd, ff = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                           s["num_key_value_heads"], s["head_dim"], s["intermediate_size"])
    N = L * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff)
    head = d * meta.get("embedding_rows", meta["vocab_size"])
    T = B * (P + R)
    gen = 2 * N * B * (P + R - 1) + 2 * head * B * R
    out = {"N_block_params": N, "lm_head_params": head, "P_mean": round(P, 2), "R": R, "B": B}
    for side, head_pos in (("rlhf", B * R), ("trl", T)):
        score = 3 * 2 * N * T + 2 * head * head_pos  # reference (head), value, reward
        train = epochs * (4 * N * T + 4 * head * head_pos + 6 * N * T)  # LoRA policy fwd + input grads; value 6N
        out[side] = {"gen_gflop": round(gen / 1e9, 1), "score_gflop": round(score / 1e9, 1),
                     "train_gflop": round(train / 1e9, 1), "update_gflop": round((gen + score + train) / 1e9, 1)}
    recompute = 2 * N * T + 2 * head * B * R
    out["rlhf_bf16_extra_gflop"] = round(recompute / 1e9, 1)
    return out


def roofline(runs: list[dict], work: Path, mm: list[dict], wl: str = "small") -> dict:
    meta = json.loads((work / wl / "workload.json").read_text())
    P = mean_padded_prompt(work / wl)
    rate = statistics.median([m["gflops"] for m in mm]) if mm else None
    out = {"workload": wl, "matmul": mm, "matmul_gflops": rate, "variants": {}}
    for variant in sorted({r["variant"] for r in runs if r["workload"] == wl}):
        R = next(r["response_length"] for r in runs if r["workload"] == wl)
        fl = update_flops(meta, P, R, variant)
        sides = {}
        for side in SIDES:
            rs = [r for r in runs if r["workload"] == wl and r["variant"] == variant and r["side_key"] == side]
            if not rs:
                continue
            t = statistics.median([x for r in rs for x in r["s_per_update"]])
            g6, gx = fl["update_gflop_6N"] / t, fl["update_gflop_executed"] / t
            sides[side] = {"s_per_update_median": round(t, 3), "gflops_6N": round(g6, 1),
                           "gflops_executed": round(gx, 1),
                           "fraction_of_matmul_6N": round(g6 / rate, 3) if rate else None,
                           "fraction_of_matmul_executed": round(gx / rate, 3) if rate else None}
        out["variants"][variant] = {"flops": fl, "sides": sides}
    return out


# ------------------------------------------------------------------------------------------------ report
def fmt3(st: dict, nd: int = 2) -> str:
    if not st or st.get("median") is None:
        return "n/a"
    return f"{st['min']:.{nd}f} / **{st['median']:.{nd}f}** / {st['max']:.{nd}f}"


def markdown(speed_res: dict | None, roof: dict | None, learn: dict | None, meta: dict,
             real_res: dict | None = None) -> str:
    L = ["# PPO benchmark: rlhf vs TRL 1.12 PPOTrainer", ""]
    L += [f"Machine: {meta.get('machine', '?')}; torch threads per process: {meta.get('threads')}; "
          f"generated {meta.get('date', '?')} by `{meta.get('command', 'bench/run.py').strip()}` "
          f"({meta.get('wall_min', '?')} min).", "",
          "This file is generated from the JSON files beside it (`bench/run.py --report-only` rewrites it). What the "
          "figures mean, where the difference comes from, earlier runs on other CPUs and the one-off probes' "
          "measurements are in the hand-written [NOTES.md](NOTES.md).", ""]
    if speed_res:
        runs_meta = speed_res.get("settings", {})
        L += ["## Speed", "",
              "Each cell is min / **median** / max over the runs of one side. Episodes per second = episodes / "
              "time of the training loop (TRL: `trainer.train()`; rlhf: first update to the end of the last, "
              "model loading excluded on both sides). Peak RSS is the process's maximum resident set "
              f"(clean page cache dropped after the installs: {meta.get('page_cache', 'not recorded')}; see "
              "`settle_page_cache` in bench/run.py). "
              f"Runs alternate between the sides ({runs_meta.get('reps', '?')} each), one process per run; the "
              "rlhf side runs from bench/.venv-rlhf, a private copy of .venv (bench/setup_rlhf_env.sh says why). "
              "Settings: 32 episodes per update (8 × 4 accumulation), rollout batch 32, 2 PPO epochs, "
              "1 mini-batch, lr 5e-6, temperature 0.7, no stop token, fp32 CPU; "
              + ", ".join(f"{w}: {sh['updates']} updates × {sh['response_length']} tokens"
                          for w, sh in runs_meta.get("shapes", FULL).items()) + ". Shapes (hidden / layers / heads "
              "/ kv heads / head_dim / intermediate, vocabulary 1,500): tiny 64/2/4/2/16/128, mini 128/4/4/2/32/384, "
              "mid 256/4/4/2/64/768, midsmall 384/5/6/3/64/1152, small 512/6/8/4/64/1536.", "",
              "| workload | variant | side | episodes/s | s per update | peak RSS (MB) | runs |",
              "|---|---|---|---|---|---|---|"]
        for key, g in speed_res["groups"].items():
            for side, st in g["sides"].items():
                L.append(f"| {g['workload']} | {g['variant']} | {side_name(side)} | {fmt3(st['eps'])} | "
                         f"{fmt3(st['s_per_update'], 3)} | {fmt3(st['peak_rss_mb'], 0)} | {st['eps']['n']} |")
        L += ["", "Ratios, rlhf / TRL per pair of neighbouring runs (min / **median** / max); RSS ratio < 1 means "
              "rlhf uses less memory:", "",
              "| workload | variant | vs | eps ratio | eps ratio on CPU time | peak RSS ratio | pairs |",
              "|---|---|---|---|---|---|---|"]
        for key, g in speed_res["groups"].items():
            for side, r in g["ratios"].items():
                L.append(f"| {g['workload']} | {g['variant']} | {side_name(r.get('vs', side))} | "
                         f"{fmt3(r['eps_ratio'])} | {fmt3(r['cpu_eps_ratio'])} | {fmt3(r['rss_ratio'], 3)} | "
                         f"{r['eps_ratio']['n']} |")
        L += split_table(speed_res["groups"], "Time split, median seconds per update (every update of every run): "
                         "generation, scoring (old / reference log-probs, values, reward scores; TRL: up to its first "
                         "forward with gradients, so its advantages too), the PPO epochs, and the rest (rlhf: "
                         "advantages, metrics; TRL: the forced gc.collect() calls and the batch request).")
        gcs = [(g["workload"], g["variant"], g["sides"]["trl"]["gc_s_per_update"], g["sides"]["trl"]["s_per_update"])
               for g in speed_res["groups"].values() if "trl" in g["sides"] and g["sides"]["trl"]["gc_s_per_update"]]
        if gcs:
            L += ["", "TRL's forced `gc.collect()` (two per update) as measured inside the gc-on runs: " + "; ".join(
                f"{w} {v}: {gc['median']:.3f} s of {sp['median']:.3f} s per update" for w, v, gc, sp in gcs) + "."]
        noise = [(g["workload"], g["variant"], side, st["eps_cv"], st["loadavg"]["median"])
                 for g in speed_res["groups"].values() for side, st in g["sides"].items()]
        if noise:
            worst = max(noise, key=lambda x: x[3])
            L += ["", f"Noise: the spread of episodes/s between repetitions of one side (coefficient of variation) "
                  f"was at most {worst[3]:.1%} ({worst[0]} {worst[1]}, {side_name(worst[2])}); the median 1-minute "
                  f"load average at the start of the runs was "
                  f"{statistics.median([n[4] for n in noise if n[4] is not None]):.2f} on "
                  f"{os.cpu_count()} cores. The CPU-time ratio (process CPU seconds of the loop) is less sensitive "
                  "to other jobs on the machine than the wall-clock ratio."]
        L.append("")
    if real_res:
        L += real_section(real_res)
    if roof:
        L += ["## Roofline (small workload)", ""]
        mm = roof.get("matmul") or []
        if roof.get("matmul_gflops"):
            L += [f"fp32 matmul rate at {meta.get('threads')} thread(s), torch.matmul on square 1024–2048 matrices "
                  f"(best of 3 × 1 s, measured {len(mm)} times): **{roof['matmul_gflops']:.1f} GFLOP/s** (median; "
                  + ", ".join(f"{m['gflops']:.1f}" for m in mm) + ").", ""]
        for variant, v in roof["variants"].items():
            fl = v["flops"]
            L += [f"**{variant}**: {fl['update_gflop_6N']:.0f} GFLOP per update by the 6N convention "
                  f"({fl['update_gflop_executed']:.0f} GFLOP executed), of which generation "
                  f"{fl['gen_gflop']:.0f}, scoring {fl['score_gflop']:.0f}, PPO epochs {fl['train_gflop_6N']:.0f} "
                  f"({fl['train_gflop_executed']:.0f} executed).", "",
                  "| side | s per update (median) | GFLOP/s (6N) | share of matmul rate | GFLOP/s (executed) | "
                  "share |", "|---|---|---|---|---|---|"]
            for side, s in v["sides"].items():
                f6 = f"{s['fraction_of_matmul_6N']:.0%}" if s["fraction_of_matmul_6N"] is not None else "n/a"
                fx = (f"{s['fraction_of_matmul_executed']:.0%}" if s["fraction_of_matmul_executed"] is not None
                      else "n/a")
                L.append(f"| {side_name(side)} | {s['s_per_update_median']:.2f} | {s['gflops_6N']:.1f} | {f6} | "
                         f"{s['gflops_executed']:.1f} | {fx} |")
            L.append("")
        fl = next(iter(roof["variants"].values()))["flops"] if roof["variants"] else None
        if fl:
            L += [f"Formula. N = block matmul weights per model = layers × (d·(h + 2·kv)·hd + h·hd·d + 3·d·ff) = "
                  f"{fl['N_block_params'] / 1e6:.2f} M; head = d·V = {fl['lm_head_params'] / 1e6:.2f} M (tied LM "
                  f"head, counted only where logits are needed); B = {fl['B']} episodes, R = {fl['R']} response "
                  f"tokens, P = {fl['P_mean']} (expected padded prompt length of a batch of 32), T = B·(P+R). "
                  "Generation 2·N·B·(P+R−1) + 2·head·B·R; scoring (reference, value, reward forwards) 3·2·N·T + "
                  "2·head·B·R; each PPO epoch, trained passes at forward 2·N·tokens + backward 4·N·tokens for the "
                  "policy (with its head on B·R positions) and the value model: 6·N·T + 6·head·B·R + 6·N·T. "
                  "'Executed' counts the LoRA policy's backward as 2·N·tokens (the frozen base needs input "
                  "gradients only; the adapters' own FLOPs are < 1%). Attention score FLOPs (≈ 1.5% here), norms "
                  "and element-wise ops are not counted. Both sides are credited with the same count; rlhf skips "
                  "the prompt padding that all rows of a forward share: in the PPO epochs micro-batches of rows "
                  "grouped by prompt length (P ≈ 20 instead of 23.4), in scoring the padding all 32 rows share "
                  "(at this vocabulary scoring runs one forward per chunk), so it executes up to 4% fewer FLOPs "
                  "than counted and its rate is up to that much overstated.", ""]
    if learn:
        s = learn["summary"]
        st = learn["settings"]
        L += ["## Learning at equal episodes (demo task)", "",
              f"Both sides start from the same `rlhf sft` policy and `rlhf reward` model (tiny recipe) and train "
              f"with the tiny recipe's PPO settings, given to both: {st['total_episodes']} episodes on the demo train "
              f"questions (chat template), {batch_text(st)}, {st['num_ppo_epochs']} PPO epochs, lr "
              f"{st['learning_rate']:g} ({st.get('lr_scheduler_type', 'linear')}, warmup "
              f"{st.get('warmup_ratio', 0):g}), kl_coef {st['kl_coef']:g}, γ {st.get('gamma', 1):g}, "
              f"λ {st.get('lam', 0.95):g}, {st['response_length']}-token responses cut at EOS, "
              f"temperature {st['temperature']:g}, {lora_text(st)}, "
              "value model from the RM, raw RM scores (no normalisation or penalties); seeds "
              f"{', '.join(map(str, st['seeds']))}. Gains: mean of the last {st['window_updates']} updates minus "
              f"mean of the first {st['window_updates']} (training samples). Held-out: `rlhf eval` on the demo "
              "test questions, same sampling seed for every policy; polite = `rlhf_cli.demo.is_polite`.", "",
              "| seed | side | RM score first → last (gain) | polite rate first → last (gain) | held-out RM | "
              "held-out polite | held-out KL |", "|---|---|---|---|---|---|---|"]
        for ps in learn["per_seed"]:
            h = ps["heldout"]
            L.append(f"| {ps['seed']} | SFT (start) | | | {h['sft']['rm_score_mean']:+.3f} | "
                     f"{h['sft']['ground_truth_rate']:.3f} | 0 |")
            for side in ("rlhf", "trl"):
                x = ps[side]
                L.append(f"| {ps['seed']} | {side_name(side)} | "
                         f"{x['rm_score']['first']:+.3f} → {x['rm_score']['last']:+.3f} "
                         f"({x['rm_score']['gain']:+.3f}) | {x['polite_rate']['first']:.3f} → "
                         f"{x['polite_rate']['last']:.3f} ({x['polite_rate']['gain']:+.3f}) | "
                         f"{h[side]['rm_score_mean']:+.3f} | {h[side]['ground_truth_rate']:.3f} | "
                         f"{h[side]['kl_to_ref_mean']:.2f} |")
        L += ["", f"Mean over seeds, held-out gain over the SFT start: RM score rlhf "
              f"{s['rlhf']['heldout_rm_gain_mean']:+.3f} "
              f"vs TRL {s['trl']['heldout_rm_gain_mean']:+.3f}; polite rate rlhf "
              f"{s['rlhf']['heldout_polite_gain_mean']:+.3f} vs TRL {s['trl']['heldout_polite_gain_mean']:+.3f} "
              f"(SFT {s['sft']['heldout_polite_mean']:.3f}); KL to the reference (nats per response) rlhf "
              f"{s['rlhf']['heldout_kl_mean']:.2f} vs TRL {s['trl']['heldout_kl_mean']:.2f}. "
              "Training-sample gains: RM rlhf "
              f"{s['rlhf']['train_rm_gain_mean']:+.3f} vs TRL {s['trl']['train_rm_gain_mean']:+.3f}; polite rlhf "
              f"{s['rlhf']['train_polite_gain_mean']:+.3f} vs TRL {s['trl']['train_polite_gain_mean']:+.3f}. "
              "The first training batches of the two sides come from the same SFT policy and differ only by "
              "sampling noise, so the held-out gains (common start, 256 prompts) decide the target.", ""]
        eff = {side: per_kl(learn, side) for side in ("rlhf", "trl")}
        if all(eff.values()):
            L += [f"Per nat of KL to the reference (held-out gain / held-out KL, mean over seeds): RM score rlhf "
                  f"{eff['rlhf'][0]:.3f} vs TRL {eff['trl'][0]:.3f}; polite rate rlhf {eff['rlhf'][1]:.4f} vs TRL "
                  f"{eff['trl'][1]:.4f}.", ""]
    analysis = HERE / "results" / "analysis.md"
    if analysis.exists():
        L += [analysis.read_text().rstrip(), ""]
    if speed_res or learn or real_res:
        L += ["## Targets", "", "| target | result | met |", "|---|---|---|"]
        for row in targets(speed_res, learn, real_res):
            L.append(f"| {row[0]} | {row[1]} | {'—' if row[2] is None else 'yes' if row[2] else 'no'} |")
        L.append("")
    L += ["## Reproduce", "", "```", "make bench                      # = .venv/bin/python bench/run.py",
          ".venv/bin/python bench/run.py --quick          # smoke run, results in bench/work/",
          ".venv/bin/python bench/rlhf_side.py --workload-dir bench/work/tiny --variant lora --updates 8 "
          "--response-length 32 --threads 1 --out r.json",
          "bench/.venv-trl112/bin/python bench/trl_side.py --workload-dir bench/work/tiny --variant lora "
          "--updates 8 --response-length 32 --threads 1 [--no-gc] --out t.json", "```", ""]
    return "\n".join(L)


def real_section(res: dict) -> list[str]:
    """The real workload's tables; the prose that explains them is in bench/results/NOTES.md (hand-written)."""
    st, meta = res["settings"], res.get("meta", {})
    sh = st["shape"]
    loads = [r["loadavg_before"] for r in res["runs"]]
    L = ["## Real workload: Qwen3-0.6B's shape, LoRA", "",
         f"Generated {meta.get('date', '?')} by `{meta.get('command', 'bench/run.py --real').strip()}` "
         f"({meta.get('wall_min', '?')} min) on {res.get('machine', '?')}, 1 torch thread per process. "
         "Qwen3-0.6B's architecture with random weights (bench/workload.py real: vocabulary rows 151,936, hidden "
         "1024, 28 layers, 16 heads, 8 kv heads, head_dim 128, intermediate 3072, tied embeddings; 596 M "
         "parameters per model), weights stored in bf16 as the released checkpoint is; reward and value models of "
         "the same shape (sequence classification, value initialised from the reward model, trained in full); "
         "prompts chat-templated with Qwen3's template (system + user turn, empty think block), 30-60 tokens. "
         f"{sh['updates']} updates × {sh['episodes_per_update']} episodes × {sh['response_length']} response "
         f"tokens, micro-batch {sh['micro_batch']} × accumulation {sh['episodes_per_update'] // sh['micro_batch']}, "
         f"rollout batch {sh['episodes_per_update']}, 2 PPO epochs, 1 mini-batch, lr 5e-6, temperature 0.7, no "
         f"stop token. Runs alternate TRL, rlhf, TRL, rlhf per precision ({st['reps']} pairs), the clean page "
         "cache dropped before each run; 1-minute load average at the start of the runs "
         f"{min(loads):.2f}-{max(loads):.2f} on 2 cores (per run in real.json).", "",
         "| precision | side | what runs in what | episodes/s | response tokens/s | s per update | peak RSS (MB) "
         "| peak reached in | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for g in res["groups"].values():
        for side, x in g["sides"].items():
            phases = sorted({p.split()[-1] for p in x["rss_peak_phases"] if p})
            L.append(f"| {g['precision']} | {side_name(side)} | {x['precision_detail']} | {fmt3(x['eps'], 4)} | "
                     f"{fmt3(x['tokens_per_s'])} | {fmt3(x['s_per_update'], 1)} | {fmt3(x['peak_rss_mb'], 0)} | "
                     f"{', '.join(phases) or 'n/a'} | {x['eps']['n']} |")
    for precision, why in (res.get("skipped") or {}).items():
        L += ["", f"{precision}: not run here: {why}."]
    L += ["", "Ratios rlhf / TRL per neighbouring pair (min / **median** / max):", "",
          "| precision | eps ratio | eps ratio on CPU time | peak RSS ratio | pairs |", "|---|---|---|---|---|"]
    for g in res["groups"].values():
        r = g["ratios"].get("trl")
        if r:
            L.append(f"| {g['precision']} | {fmt3(r['eps_ratio'])} | {fmt3(r['cpu_eps_ratio'])} | "
                     f"{fmt3(r['rss_ratio'], 3)} | {r['eps_ratio']['n']} |")
    L += split_table(res["groups"], "Time split, median seconds per update (both updates of every run).")
    fl, mm = res.get("flops"), res.get("matmul") or []
    if fl:
        rate = {d: statistics.median([m["gflops"] for m in mm if m["dtype"] == d]) for d in {m["dtype"] for m in mm}}
        L += ["", f"Matmul work per update (N = {fl['N_block_params'] / 1e6:.0f} M block weights, LM head "
              f"{fl['lm_head_params'] / 1e6:.1f} M, B = {fl['B']}, R = {fl['R']}, expected padded prompt P = "
              f"{fl['P_mean']}; formula in `real_flops`): rlhf {fl['rlhf']['update_gflop']:.0f} GFLOP (generation "
              f"{fl['rlhf']['gen_gflop']:.0f}, scoring {fl['rlhf']['score_gflop']:.0f}, PPO epochs "
              f"{fl['rlhf']['train_gflop']:.0f}; bf16 adds {fl['rlhf_bf16_extra_gflop']:.0f} for the recomputed "
              f"old log-probs), TRL {fl['trl']['update_gflop']:.0f} GFLOP (its LM head also runs over the prompt "
              "positions of the reference and training forwards). Matmul rate of this machine at 1 thread "
              "(square 1024-2048 matrices, median of the measurements before and after the runs): "
              + (", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in sorted(rate.items())) or "not in this real.json")
              + ".", "",
              "| precision | side | s per update | GFLOP/s achieved | share of the matmul rate |",
              "|---|---|---|---|---|"]
        for g in res["groups"].values():
            r = rate.get("float32" if g["precision"] == "fp32" else "bfloat16")
            for side, x in g["sides"].items():
                who = "trl" if side.startswith("trl") else "rlhf"
                work = fl[who]["update_gflop"] + (fl["rlhf_bf16_extra_gflop"] if who == "rlhf" and
                                                  g["precision"] == "bf16" else 0)
                t = x["s_per_update"]["median"]
                L.append(f"| {g['precision']} | {side_name(side)} | {t:.1f} | {work / t:.1f} | "
                         f"{work / t / r:.0%} |" if r else f"| {g['precision']} | {side_name(side)} | {t:.1f} | "
                         f"{work / t:.1f} | n/a |")
    L.append("")
    return L


def split_table(groups: dict, intro: str) -> list[str]:
    L = ["", intro, "", "| workload | variant | precision | side | generate | score | PPO epochs | rest | "
         "update |", "|---|---|---|---|---|---|---|---|---|"]
    for g in groups.values():
        for side, st in g["sides"].items():
            sp = st.get("split_s_median")
            if not sp:
                continue
            L.append(f"| {g['workload']} | {g['variant']} | {g.get('precision', 'fp32')} | {side_name(side)} | "
                     + " | ".join(f"{sp.get(k, float('nan')):.3f}" for k in SPLIT_KEYS)
                     + f" | {st['s_per_update']['median']:.3f} |")
    return L


def per_kl(learn: dict, side: str) -> tuple[float, float] | None:
    rows = [ps["heldout"] for ps in learn["per_seed"] if ps["heldout"][side].get("kl_to_ref_mean")]
    if not rows:
        return None
    rm = [(h[side]["rm_score_mean"] - h["sft"]["rm_score_mean"]) / h[side]["kl_to_ref_mean"] for h in rows]
    gt = [(h[side]["ground_truth_rate"] - h["sft"]["ground_truth_rate"]) / h[side]["kl_to_ref_mean"] for h in rows]
    return sum(rm) / len(rm), sum(gt) / len(gt)


def batch_text(st: dict) -> str:
    if "per_device_train_batch_size" not in st:
        return "32 episodes per update"
    micro, acc, mini = st["per_device_train_batch_size"], st["gradient_accumulation_steps"], st["num_mini_batches"]
    text = f"{micro * acc * mini} episodes per update ({micro} × {acc} accumulation × {mini} mini-batches)"
    recipe = st.get("recipe_num_mini_batches")
    if recipe is not None and recipe != mini:
        text += (f"; the recipe's {recipe} mini-batches become {mini} on both sides, because TRL 1.12 steps its "
                 "optimizer once per accumulation window whatever its num_mini_batches, so only one mini-batch "
                 "means the same work on both")
    return text


def lora_text(st: dict) -> str:
    lo = st.get("lora")
    return f"LoRA r {lo['r']} / alpha {lo['alpha']} on {lo['target_modules']}" if lo else "LoRA"


def targets(speed_res: dict | None, learn: dict | None, real_res: dict | None = None
            ) -> list[tuple[str, str, bool | None]]:
    """The benchmark's targets, each judged on the median of the per-pair ratios (neighbouring runs)."""
    rows = []

    def med(g, vs, what="eps_ratio"):
        r = g["ratios"].get(vs, {}).get(what)
        return r["median"] if r and r.get("median") is not None else None

    for g in (speed_res or {}).get("groups", {}).values():
        name = f"{g['workload']} {g['variant']}"
        m = med(g, "trl_nogc")
        if m is not None:
            rows.append((f"{name}: rlhf ≥ TRL 1.12 gc off, episodes/s", f"{m:.2f}× (median pair)", m >= 1.0))
        if g["workload"] in BETWEEN and med(g, "trl") is not None:
            m = med(g, "trl")
            rows.append((f"{name}: rlhf ≥ 1.3× TRL 1.12 (gc on), episodes/s", f"{m:.2f}× (median pair)", m >= 1.3))
        r = med(g, "trl", "rss_ratio")
        if r is not None:
            a, b = g["sides"]["rlhf"]["peak_rss_mb"]["median"], g["sides"]["trl"]["peak_rss_mb"]["median"]
            rows.append((f"{name}: peak RSS ≤ TRL's", f"{r:.3f} (median pair; {a:.0f} vs {b:.0f} MB medians)",
                         r <= 1.0))
    for g in (real_res or {}).get("groups", {}).values():
        name = f"real {g['variant']} {g['precision']}"
        m, r = med(g, "trl"), med(g, "trl", "rss_ratio")
        if m is not None:
            rows.append((f"{name}: rlhf ≥ 1.3× TRL 1.12 episodes/s", f"{m:.2f}× (median pair)", m >= 1.3))
        if r is not None:
            rows.append((f"{name}: peak RSS ≤ 0.8× TRL's", f"{r:.3f} (median pair)", r <= 0.8))
    for precision, why in ((real_res or {}).get("skipped") or {}).items():
        rows.append((f"real lora {precision}: rlhf ≥ 1.3× TRL 1.12, peak RSS ≤ 0.8× TRL's", f"not run: {why}", None))
    if learn:
        s = learn["summary"]
        rows.append(("demo: rlhf RM score gain ≥ TRL's at equal episodes (held-out, over SFT)",
                     f"{s['rlhf']['heldout_rm_gain_mean']:+.3f} vs {s['trl']['heldout_rm_gain_mean']:+.3f}",
                     s["target_rm_gain_met"]))
        # the issue's target is the reward gain; the rule-checked polite rate is reported beside it
        rows.append(("demo: polite-rate gain (held-out, over SFT; reported beside the target)",
                     f"rlhf {s['rlhf']['heldout_polite_gain_mean']:+.3f} vs TRL "
                     f"{s['trl']['heldout_polite_gain_mean']:+.3f} (final rates {s['rlhf']['heldout_polite_mean']:.3f}"
                     f" vs {s['trl']['heldout_polite_mean']:.3f})", None))
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}"


# -------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 2 tiny / 1 small update, no "
                    "learning comparison; results go to bench/work/results-quick/")
    ap.add_argument("--reps", type=int, default=None, help="runs per side (default 3; --quick: 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", nargs="+", default=["tiny", "mini", "mid", "midsmall", "small"], choices=list(FULL))
    ap.add_argument("--variants", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--only", nargs="+", choices=["speed", "roofline", "learning"], default=None)
    ap.add_argument("--real", action="store_true", help="the real workload (Qwen3-0.6B's shape, LoRA) instead of "
                    "the quick ones; results in real.json")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                    help="--real: precisions to run (default both)")
    ap.add_argument("--sides", nargs="+", default=["trl", "rlhf"], choices=["trl", "rlhf"],
                    help="--real: the sides, in the order they alternate")
    ap.add_argument("--rep-start", type=int, default=1, help="number of the first repetition (with --merge: add "
                    "repetitions to earlier ones)")
    ap.add_argument("--merge", action="store_true", help="keep the runs already in speed.json / real.json whose "
                    "workload, variant, precision and side this invocation does not run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="learning comparison seeds")
    ap.add_argument("--results-dir", default=None, help="default bench/results (--quick: bench/work/results-quick)")
    ap.add_argument("--report-only", action="store_true", help="rewrite README.md from the JSON files present")
    a = ap.parse_args(argv)
    a.reps = a.reps or (1 if a.quick else 2 if a.real else 3)
    parts = set(a.only or (["speed", "roofline"] if a.quick else ["speed", "roofline", "learning"]))
    work = HERE / "work"
    results = Path(a.results_dir) if a.results_dir else (work / "results-quick" if a.quick else HERE / "results")
    results.mkdir(parents=True, exist_ok=True)
    logfile = work / "bench.log"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    meta = {"machine": machine(), "threads": a.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])}

    def load(name):
        p = results / name
        return json.loads(p.read_text()) if p.exists() else None

    def merged(name, runs):
        old = load(name) if a.merge else None
        if not old:
            return runs
        fresh = {(*group_key(r), r["side_key"], r["rep"]) for r in runs}
        return [r for r in old["runs"] if (*group_key(r), r["side_key"], r["rep"]) not in fresh] + runs

    if a.real and not a.report_only:
        setup(work, ["real"], logfile, need_trl=True)
        meta["page_cache"] = settle_page_cache()
        log(f"page cache before the timed runs: {meta['page_cache']}")
        runs, extra = real(a, work, logfile)
        runs = merged("real.json", runs)
        meta["wall_min"] = round((time.perf_counter() - t_start) / 60, 1)
        real_res = {**extra, "settings": {"reps": a.reps, "threads": a.threads,
                                 "shape": QUICK_REAL if a.quick else REAL,
                                 "quick": a.quick, "precisions": a.precisions},
                    "machine": meta["machine"], "meta": meta, "groups": summarise_speed(runs), "runs": runs}
        (results / "real.json").write_text(json.dumps(real_res, indent=2) + "\n")
        parts = set()
    if not a.report_only and parts:
        if "roofline" in parts and "small" not in a.workloads:
            parts.discard("roofline")
        setup(work, a.workloads, logfile, need_trl=True)
        meta["page_cache"] = settle_page_cache()
        log(f"page cache before the timed runs: {meta['page_cache']}")
        shapes = QUICK if a.quick else FULL
        mm = []
        if "roofline" in parts:
            mm.append(matmul_rate(a.threads))
            log(f"fp32 matmul: {mm[-1]['gflops']} GFLOP/s at {a.threads} thread(s)")
        if "speed" in parts or "roofline" in parts:
            runs = merged("speed.json", speed(a, work, shapes, logfile))
            speed_res = {"settings": {"reps": a.reps, "threads": a.threads, "shapes": shapes, "quick": a.quick,
                                      "episodes_per_update": EPISODES_PER_UPDATE},
                         "machine": meta["machine"], "groups": summarise_speed(runs), "runs": runs}
            (results / "speed.json").write_text(json.dumps(speed_res, indent=2) + "\n")
            if "roofline" in parts:
                mm.append(matmul_rate(a.threads))
                log(f"fp32 matmul: {mm[-1]['gflops']} GFLOP/s at {a.threads} thread(s)")
                roof = roofline(runs, work, mm)
                (results / "roofline.json").write_text(json.dumps(roof, indent=2) + "\n")
        if "learning" in parts:
            log("learning comparison (bench/learning.py)")
            r = subprocess.run([str(PY), str(HERE / "learning.py"), "--seeds", *map(str, a.seeds), "--threads",
                                str(a.threads), "--out", str(results / "learning.json")], cwd=str(REPO),
                               env=env_for(a.threads))
            if r.returncode != 0:
                raise SystemExit("learning comparison failed; see bench/work/demo/learning.log")
    speed_res = load("speed.json")
    if a.report_only or "speed" not in parts or a.real:
        # the header describes the speed runs; the learning section states its own settings
        meta = (speed_res or {}).get("meta", meta)
    else:
        meta["wall_min"] = round((time.perf_counter() - t_start) / 60, 1)
        if speed_res is not None and "speed" in parts:
            speed_res["meta"] = meta
            (results / "speed.json").write_text(json.dumps(speed_res, indent=2) + "\n")
    real_res = load("real.json")
    wl_meta = work / "real" / "workload.json"
    if real_res and not real_res.get("flops") and wl_meta.exists():
        sh = real_res["settings"]["shape"]
        real_res["flops"] = real_flops(json.loads(wl_meta.read_text()), mean_padded_prompt(
            work / "real", batch=sh["episodes_per_update"]), sh["response_length"], sh["episodes_per_update"])
    for res in (speed_res, real_res):
        if res and res.get("runs"):
            res["groups"] = summarise_speed(res["runs"])  # the tables from the runs, as this version summarises
    md = markdown(speed_res, load("roofline.json"), load("learning.json"), meta, real_res)
    (results / "README.md").write_text(md)
    log(f"wrote {results / 'README.md'}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
