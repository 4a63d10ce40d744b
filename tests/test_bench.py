"""The benchmark's rlhf side runs on a 1-update tiny workload and writes the result fields both sides share.
Speed itself is measured by `make bench`, never here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

SHARED_FIELDS = {"side", "transformers_version", "torch_version", "variant", "workload", "workload_dir", "updates",
                 "episodes", "response_length", "train_s", "eps", "s_per_update", "peak_rss_mb", "threads",
                 "gc_disabled", "gc_calls", "gc_s", "scores_first", "scores_last", "kl_last", "trainable_params"}


@pytest.mark.slow
def test_rlhf_side_one_update_on_tiny_workload(tmp_path):
    env_py = sys.executable
    wdir = tmp_path / "tiny"
    subprocess.run([env_py, str(BENCH / "workload.py"), "tiny", str(wdir)], check=True, capture_output=True,
                   timeout=1500)
    out = tmp_path / "r.json"
    proc = subprocess.run([env_py, str(BENCH / "rlhf_side.py"), "--workload-dir", str(wdir), "--variant", "lora",
                           "--updates", "1", "--response-length", "8", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert SHARED_FIELDS <= r.keys()
    assert r["side"] == "rlhf" and r["variant"] == "lora" and r["workload"] == "tiny"
    assert r["updates"] == 1 and r["episodes"] == 32 and r["response_length"] == 8
    assert r["train_s"] > 0 and r["eps"] == pytest.approx(32 / r["train_s"], rel=1e-2)
    assert len(r["s_per_update"]) == 1 and r["peak_rss_mb"] > 0
    assert r["prompt_tokens_identical"] is True and r["prompts_checked"] > 500
    assert r["scores_first"] is not None and r["kl_last"] is not None
    # LoRA r 8 on every linear layer of the policy + the whole value model are trained
    assert r["trainable_params"] > 0
    # the prepared inputs stay in the workload directory for later runs
    assert (wdir / "rlhf_policy" / "tokenizer.json").exists() and (wdir / "rlhf_prompts.jsonl").exists()


def _bench_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_real_bf16_skipped_without_bf16_units():
    """bench-real's bf16 pairs run only where bf16 matmuls keep at least a quarter of the fp32 rate; otherwise the
    reason, with both rates, goes into the targets table as not run (neither met nor failed)."""
    run = _bench_run()
    mm = lambda f32, b16: [{"dtype": "float32", "gflops": f32}, {"dtype": "bfloat16", "gflops": b16}]  # noqa: E731
    assert run.bf16_unfit(mm(150.0, 300.0)) is None  # AMX: bf16 faster
    assert run.bf16_unfit(mm(150.0, 40.0)) is None  # at the threshold's side that still runs
    why = run.bf16_unfit(mm(49.0, 0.64))
    assert "0.64 vs fp32 49" in why and "77x slower" in why
    rows = run.targets(None, None, {"groups": {}, "skipped": {"bf16": why}})
    assert rows == [("real lora bf16: rlhf ≥ 1.3× TRL 1.12, peak RSS ≤ 0.8× TRL's", f"not run: {why}", None)]


def test_report_renders_a_real_run_with_bf16_skipped():
    """The whole report (speed, roofline, learning and a real run whose bf16 pairs were skipped) renders from
    result files shaped as bench/run.py writes them: the skip reason and the fp32 ratio rows appear."""
    run = _bench_run()
    results = BENCH / "results"
    load = lambda n: json.loads((results / n).read_text()) if (results / n).exists() else None  # noqa: E731
    real = load("real.json")
    if real is None:
        pytest.skip("no bench/results/real.json")
    real = {**real, "skipped": {"bf16": run.bf16_unfit([{"dtype": "float32", "gflops": 64.0},
                                                        {"dtype": "bfloat16", "gflops": 1.3}])}}
    md = run.markdown(load("speed.json"), load("roofline.json"), load("learning.json"), {"threads": 1}, real)
    assert "bf16: not run here: this CPU has no bf16 matmul units" in md
    assert "| real lora bf16: rlhf ≥ 1.3× TRL 1.12, peak RSS ≤ 0.8× TRL's | not run: " in md
    assert "real lora fp32: rlhf ≥ 1.3× TRL 1.12 episodes/s" in md


def test_generated_report_links_the_hand_written_notes():
    """bench/run.py rewrites bench/results/README.md on every run; the prose that explains its figures lives in
    NOTES.md beside it, which the generated header links and the generator never writes."""
    md = _bench_run().markdown(None, None, None, {"threads": 1})
    assert "[NOTES.md](NOTES.md)" in md
    assert (BENCH / "results" / "NOTES.md").is_file()


def test_probes_say_how_to_run_them_and_docs_name_existing_bench_files():
    """Each one-off probe's docstring says what it measures and gives its own command line; every bench/ script
    the user docs name exists."""
    import ast
    import re

    probes = sorted((BENCH / "probes").glob("*.py"))
    assert probes
    for p in probes:
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
        assert f"bench/probes/{p.name}" in doc, f"{p.name}: its docstring gives no command line"
    repo = BENCH.parent
    for doc in (repo / "README.md", BENCH / "results" / "NOTES.md"):
        for path in set(re.findall(r"\bbench/[\w/.-]+\.(?:py|sh)\b", doc.read_text(encoding="utf-8"))):
            assert (repo / path).is_file(), f"{doc.name} names {path}, which does not exist"
