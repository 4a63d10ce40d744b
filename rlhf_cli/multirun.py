"""Multiruns (`rlhf <stage> -m key=a,b`): where each job writes its stage output, the directory names Hydra
gives the jobs, and the sweep's summary (summary.txt / summary.json, one line per job with its headline
metric).

Kept import-light like the dispatcher: Hydra is imported inside the functions that run during a sweep.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from rlhf_cli.config import job_dir_name, quote
from rlhf_cli.stage_table import BY_NAME, STAGES


def current_job():
    """Hydra's config of this job in a multirun (num, override_dirname, runtime.output_dir), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return HydraConfig.get()


# where each command writes; a multirun job writes there inside its own directory instead
OUTPUT_KEYS = {s.name: s.output_key for s in STAGES if s.output}


def job_output(command: str, job) -> tuple[str, str] | None:
    """(key, `<job dir>/<command>`): the output directory of a multirun job, so that the jobs of a sweep do
    not replace each other's <run_dir>/<command>. The inputs (e.g. reward's SFT model) stay the run's. None
    for commands that write nothing, or when the command line sets the key itself."""
    key = OUTPUT_KEYS.get(str(command))
    if key is None:
        return None
    if any(o.split("=", 1)[0].lstrip("+~") == key for o in job.overrides.task):
        return None
    return key, str(Path(job.runtime.output_dir) / str(command))


# ------------------------------------------------------------------------------------------------- summary
def headline(command: str, output_dir: str | Path | None) -> tuple[str, float | None] | None:
    """The one metric a sweep is compared by, from the job's output: sft eval_loss_end, reward eval_accuracy,
    ppo objective/scores (last update), eval the first win rate. None for commands that report none."""
    if output_dir is None:
        return None
    out = Path(output_dir)
    if command == "eval":
        report = _read_json(out / "report.json")
        rates = report.get("win_rate") or {}
        first = next(iter(rates), None)
        return (f"win_rate/{first}", rates[first]) if first else ("win_rate", None)
    key = BY_NAME[command].headline if command in BY_NAME else None
    if key is None:
        return None
    return key, _read_json(out / "metrics.json").get(key)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def summary_lines(rows: list[dict], sweep_dir: Path | None = None) -> list[str]:
    """One aligned line per job: its directory name, its headline metric (or the error), its output (relative
    to `sweep_dir` when inside it)."""
    cells = []
    for r in rows:
        out = r["output_dir"] or ""
        if out and sweep_dir is not None:
            with contextlib.suppress(ValueError):
                out = str(Path(out).resolve().relative_to(sweep_dir.resolve()))
        if r["error"]:
            result = f"failed: {r['error']}"
        elif r["metric"] is None:
            result = "done"
        else:
            value = r["value"]
            result = f"{r['metric']} {value:.4g}" if isinstance(value, (int, float)) else f"{r['metric']} n/a"
        cells.append((r["name"], result, out))
    w0 = max((len(c[0]) for c in cells), default=0)
    w1 = max((len(c[1]) for c in cells if not c[1].startswith("failed")), default=0)
    return [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in cells]


class MultirunSummary:
    """A Hydra callback (conf/config.yaml, hydra.callbacks): after every job of a multirun, rewrites
    <sweep dir>/summary.txt (one line per job with its headline metric) and summary.json, so a sweep that
    stops early still has one; prints it at the end. Does nothing in a single run. Hydra calls every hook
    by name, so all six are here (subclassing hydra's Callback would import Hydra for `rlhf --help`)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.sweep_dir: Path | None = None

    def on_run_start(self, config, **kwargs) -> None:
        pass

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_multirun_start(self, config, **kwargs) -> None:
        self.rows, self.sweep_dir = [], Path(str(config.hydra.sweep.dir))

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        command = str(config.command)
        result = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if not isinstance(result, dict):
            result = {"output_dir": None, "error": "failed (see the job's log)"}
        top = headline(command, result.get("output_dir")) if not result.get("error") else None
        self.rows.append({
            "job": int(config.hydra.job.num),
            "name": job_dir_name(config.hydra.job.num, config.hydra.job.override_dirname),
            "overrides": [o for o in job_return.overrides if not o.startswith(("hydra.", "command="))],
            "output_dir": result.get("output_dir"),
            "metric": top[0] if top else None,
            "value": top[1] if top else None,
            "error": result.get("error"),
        })
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self._write(command)

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.rows and self.sweep_dir is not None:
            print(f"rlhf {config.command}: {len(self.rows)} job(s); {self.sweep_dir / 'summary.txt'}:")
            print("\n".join(summary_lines(self.rows, self.sweep_dir)))

    def _write(self, command: str) -> None:
        d = self.sweep_dir
        d.mkdir(parents=True, exist_ok=True)
        head = f"# rlhf {command} multirun in {d}: job, headline metric, output"
        lines = [head, *summary_lines(self.rows, d)]
        (d / "summary.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (d / "summary.json").write_text(json.dumps(self.rows, indent=1) + "\n", encoding="utf-8")


def dirname_excludes(overrides: list[str]) -> str | None:
    """Hydra names a job's directory after all its overrides (hydra.job.override_dirname); this override
    leaves out the ones every job shares, so the name shows what the sweep varies. None when Hydra's parser
    refuses the overrides (Hydra then reports them itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - reported by Hydra with its own message
        return None
    keys = sorted({o.key_or_group for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()})
    return "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(quote(k) for k in keys) + "]"
