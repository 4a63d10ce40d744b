"""What an installed `rlhf` needs beyond the checkout: the wheel carries conf/ and recipes/ and runs from an
empty directory; multirun jobs get their own directories and a summary; wandb logs offline beside TensorBoard.

The wheel is built from a copy of the source and installed with `pip install --no-deps --target`, so it reuses
the dependencies of this environment (no network, no second install of torch); PYTHONPATH puts it before the
editable checkout, and a check confirms the wheel's package is the one imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from clitools import EVAL_ROWS

ROOT = Path(__file__).resolve().parents[1]


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)


def _source_files() -> dict[str, Path]:
    """Wheel path -> source file, for what the wheel must carry: every module and demo file of rlhf_cli, and
    conf/ and recipes/ under rlhf_cli/_config/."""
    want = {}
    for path in (ROOT / "rlhf_cli").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".jsonl"):
            want[path.relative_to(ROOT).as_posix()] = path
    for folder in ("conf", "recipes"):
        for path in (ROOT / folder).rglob("*.yaml"):
            want[f"rlhf_cli/_config/{path.relative_to(ROOT).as_posix()}"] = path
    return want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """(wheel file, build log), built without isolation from a copy of the source (the checkout is left as it
    is: no build/ or egg-info written there)."""
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("setuptools >= 77 (the SPDX license field) is needed to build the wheel")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("rlhf_cli", "conf", "recipes"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    proc = _pip("wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                str(src))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("rlhf_cli-*.whl")
    return whl, proc.stdout + proc.stderr


def test_wheel_carries_the_package_configs_and_recipes(wheel):
    whl, _ = wheel
    names = set(zipfile.ZipFile(whl).namelist())
    want = _source_files()
    missing = sorted(set(want) - names)
    assert not missing, f"not in the wheel (pyproject.toml: packages / package-data): {missing}"
    assert {"rlhf_cli/_config/conf/config.yaml", "rlhf_cli/_config/recipes/tiny.yaml"} <= names
    with zipfile.ZipFile(whl) as z:  # the same files, not a second copy to keep in step
        for name in ("rlhf_cli/_config/conf/config.yaml", "rlhf_cli/_config/recipes/tiny.yaml"):
            assert z.read(name) == want[name].read_bytes()


def test_wheel_metadata_license_and_extras(wheel):
    whl, log = wheel
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Provides-Extra: wandb" in meta
    lines = log.lower().splitlines()
    assert not [ln for ln in lines if "license" in ln and "deprecat" in ln], "license deprecation warning"
    assert not [ln for ln in lines if "absent from the `packages` configuration" in ln]


@pytest.mark.slow
def test_installed_wheel_runs_from_an_empty_directory(wheel, tmp_path):
    whl, _ = wheel
    site = tmp_path / "site"
    proc = _pip("install", "--no-deps", "--no-index", "--target", str(site), str(whl))
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RLHF_RECIPES"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(site / "bin" / "rlhf"), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=900, check=False)

    # the wheel's package is the one imported, and it reads its own copy of the configs
    code = "import rlhf_cli.config as c; print(c.PACKAGE_DIR); print(c.CONF_DIR); print(c.RECIPES_DIR)"
    probe = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                           check=False)
    assert probe.returncode == 0, probe.stderr
    package, conf, recipes = map(Path, probe.stdout.split())
    assert package == (site / "rlhf_cli").resolve()
    assert conf == package / "_config" / "conf" and recipes == package / "_config" / "recipes"

    p = run("sft", "--cfg", "job")
    assert p.returncode == 0, p.stderr
    assert "recipe: tiny" in p.stdout and "learning_rate:" in p.stdout
    p = run("doctor")
    assert p.returncode == 0, p.stderr
    p = run("recipes", "copy", "tiny", "my-tiny")
    assert p.returncode == 0, p.stderr
    assert (work / "recipes" / "my-tiny.yaml").is_file()
    p = run("sft", "recipe=my-tiny", "--cfg", "job")
    assert p.returncode == 0, p.stderr
    assert "recipe: my-tiny" in p.stdout
    p = run("recipes")
    assert p.returncode == 0, p.stderr
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines()
             if ln.strip() and not ln.startswith((" ", "searched", "`"))}  # a row, not its wrapped summary
    assert "shipped" in lines["tiny"] and "recipes/my-tiny.yaml" in lines["my-tiny"]
    p = run("sft", "sft.max_steps=2", "device.threads=1", "data.max_rows=64", EVAL_ROWS)  # the shipped data, 64 rows of it
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = json.loads((work / "runs" / "tiny" / "sft" / "metrics.json").read_text())
    assert metrics["steps"] == 2
    assert not (site / "runs").exists()


def test_editable_install_reads_the_repository_folders(tmp_path):
    """An editable install (PEP 660, what `make install` does) of a copy of the source composes from that
    copy's top-level conf/ and recipes/. Python starts without `site` (-S) so this environment's own
    editable finder for the checkout is not loaded; its dependencies come after the one under test."""
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("setuptools >= 77 (the SPDX license field) is needed to build the wheel")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("rlhf_cli", "conf", "recipes"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    hook = f"import setuptools.build_meta as b; b.build_editable({str(tmp_path / 'dist')!r})"
    build = subprocess.run([sys.executable, "-c", hook], cwd=src, capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("*.whl")
    proc = _pip("install", "--no-deps", "--no-index", "--target", str(tmp_path / "site"), str(whl))
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "empty"
    work.mkdir()
    deps = sysconfig.get_paths()["purelib"]
    code = (f"import site, sys; site.addsitedir({str(tmp_path / 'site')!r}); sys.path.append({deps!r}); "
            "import rlhf_cli.config as c; print(c.PACKAGE_DIR); print(c.CONF_DIR); print(c.RECIPES_DIR); "
            "from rlhf_cli.cli import main; main(['sft', 'recipe=qwen3-0.6b', '--cfg', 'job'])")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLHF_RECIPES")}
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=work, env=env, capture_output=True,
                         text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    package, conf, recipes = map(Path, run.stdout.splitlines()[:3])
    assert (package, conf, recipes) == (src / "rlhf_cli", src / "conf", src / "recipes")
    assert "recipe: qwen3-0.6b" in run.stdout


def test_help_and_recipe_listing_import_no_torch():
    code = ("import sys; from rlhf_cli.cli import main; main(['--help']); main(['recipes']); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False False"
    assert "recipes" in proc.stdout and "tiny" in proc.stdout


# ------------------------------------------------------------------------------------------------ multirun
@pytest.mark.slow
def test_multirun_jobs_get_their_own_directories_and_a_summary(run_cli, tmp_path):
    rc, out, err = run_cli("sft", "-m", "sft.max_steps=2,3", "device.threads=1", "data.max_rows=64", EVAL_ROWS,
                           timeout=900)
    assert rc == 0, err[-3000:]
    assert not (tmp_path / "runs" / "tiny" / "sft").exists()  # the run's own sft/ is left alone
    (sweep,) = (tmp_path / "runs" / "tiny" / "multirun" / "sft").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0_sft.max_steps=2", "1_sft.max_steps=3"]  # the swept value names it, not the fixed keys
    for job, steps in zip(jobs, (2, 3)):
        assert json.loads((sweep / job / "sft" / "metrics.json").read_text())["steps"] == steps
        assert (sweep / job / ".hydra" / "overrides.yaml").is_file()
    summary = (sweep / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("# rlhf sft multirun")
    assert [ln.split()[0] for ln in summary[1:]] == jobs
    assert all("eval_loss_end" in ln for ln in summary[1:])
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["overrides"][0] for r in rows] == ["sft.max_steps=2", "sft.max_steps=3"]
    assert all(isinstance(r["value"], float) and r["error"] is None for r in rows)
    assert "summary.txt" in out


def test_multirun_reports_failed_jobs_and_goes_on(run_cli, tmp_path):
    rc, out, err = run_cli("sft", "-m", "sft.learning_rate=-1,0", timeout=600)
    assert rc != 0
    assert "Traceback" not in out + err
    assert "job 0_sft.learning_rate=-1: sft.learning_rate=-1 is out of range" in err
    assert "job 1_sft.learning_rate=0:" in err  # the second job ran after the first failed
    assert err.strip().splitlines()[-1].startswith("rlhf sft: error: 2 job(s) of the multirun failed")
    (sweep,) = (tmp_path / "runs" / "tiny" / "multirun" / "sft").iterdir()
    lines = (sweep / "summary.txt").read_text().splitlines()[1:]
    assert len(lines) == 2 and all("failed: sft.learning_rate=" in ln for ln in lines)


def test_hydra_mode_multirun_on_the_command_line_sweeps_as_dash_m_does(run_cli, tmp_path):
    """rlhf_cli.cli reads hydra.mode from the command line only (it skips Hydra's extra composition that looks
    for it in the config): given there, it sweeps, with the job names of `-m`."""
    rc, out, err = run_cli("sft", "hydra.mode=MULTIRUN", "sft.learning_rate=-1,0", timeout=600)
    assert rc != 0 and "Traceback" not in out + err
    assert "job 0_sft.learning_rate=-1: sft.learning_rate=-1 is out of range" in err
    assert "job 1_sft.learning_rate=0:" in err
    (sweep,) = (tmp_path / "runs" / "tiny" / "multirun" / "sft").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_sft.learning_rate=-1", "1_sft.learning_rate=0"]


def test_headline_metrics_by_command(tmp_path):
    from rlhf_cli.multirun import headline, summary_lines

    (tmp_path / "metrics.json").write_text(json.dumps({"eval_loss_end": 1.5, "eval_accuracy": 0.75,
                                                       "objective/scores": 0.25}))
    (tmp_path / "report.json").write_text(json.dumps({"win_rate": {"ppo_vs_sft": 0.8}}))
    assert headline("sft", tmp_path) == ("eval_loss_end", 1.5)
    assert headline("reward", tmp_path) == ("eval_accuracy", 0.75)
    assert headline("ppo", tmp_path) == ("objective/scores", 0.25)
    assert headline("eval", tmp_path) == ("win_rate/ppo_vs_sft", 0.8)
    assert headline("doctor", tmp_path) is None
    assert headline("sft", tmp_path / "missing") == ("eval_loss_end", None)
    rows = [{"name": "0_a=1", "metric": "eval_accuracy", "value": 0.75, "error": None,
             "output_dir": str(tmp_path / "0_a=1" / "reward")},
            {"name": "1_a=2", "metric": None, "value": None, "error": "boom", "output_dir": None}]
    assert summary_lines(rows, tmp_path) == ["0_a=1  eval_accuracy 0.75  0_a=1/reward", "1_a=2  failed: boom"]


# ------------------------------------------------------------------------------------------------ tracking
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode with its settings and caches under tmp_path (nothing in the home directory)."""
    pytest.importorskip("wandb")
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_ENTITY", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def test_report_to_defaults_to_tensorboard_only(monkeypatch):
    from rlhf_cli import tracking
    from rlhf_cli.config import compose
    from rlhf_cli.settings import of

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert tracking.trainer_report_to(of(compose("sft"))) == ["tensorboard"]
    assert "WANDB_PROJECT" not in os.environ
    assert tracking.trainer_report_to(of(compose("sft", ["logging.report_to=[]"]))) == []
    assert not tracking.make_writer(of(compose("ppo")), "unused", is_main=False, composed=compose("ppo")).enabled


def test_wandb_not_installed_is_a_one_line_error(monkeypatch):
    from rlhf_cli import tracking
    from rlhf_cli.config import compose
    from rlhf_cli.settings import of
    from rlhf_cli.errors import RlhfError

    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RlhfError, match=r"wandb is not installed: pip install 'rlhf-cli\[wandb\]'"):
        tracking.trainer_report_to(of(compose("sft", ["logging.report_to=[tensorboard,wandb]"])))


def test_trainer_report_to_passes_the_wandb_settings_by_environment(wandb_offline):
    from rlhf_cli import tracking
    from rlhf_cli.config import compose
    from rlhf_cli.settings import of

    cfg = compose("reward", ["logging.report_to=[tensorboard,wandb]", f"logging.wandb.dir={wandb_offline}",
                             "logging.wandb.project=p1"])
    assert tracking.trainer_report_to(of(cfg)) == ["tensorboard", "wandb"]
    assert os.environ["WANDB_PROJECT"] == "p1"
    assert os.environ["WANDB_NAME"] == "tiny-reward"
    assert os.environ["WANDB_RUN_GROUP"] == "tiny"
    assert os.environ["WANDB_DIR"] == str(wandb_offline.resolve())
    assert os.environ["WANDB_MODE"] == "offline"  # logging.wandb.mode=null leaves the user's setting
    assert "WANDB_ENTITY" not in os.environ


def test_ppo_writer_logs_tensorboard_and_wandb_offline(wandb_offline):
    from rlhf_cli import tracking
    from rlhf_cli.config import compose
    from rlhf_cli.settings import of

    cfg = compose("ppo", ["logging.report_to=[tensorboard,wandb]", f"logging.wandb.dir={wandb_offline}"])
    hooks = (sys.exit, sys.excepthook)
    writer = tracking.make_writer(of(cfg), wandb_offline / "tb", is_main=True, composed=cfg)
    assert writer.enabled and writer.wandb_run is not None
    assert writer.wandb_run.name == "tiny-ppo"
    assert writer.wandb_run.config["ppo"]["kl_coef"] == cfg.ppo.kl_coef  # the composed config is the run's
    for step in (64, 128):
        writer.add_scalar("objective/scores", 0.5, step)
        writer.add_scalar("objective/kl", 0.1, step)
    writer.add_text("samples", "| prompt | response |\n|---|---|\n| 'hi' | 'hello' |", 128)
    writer.close()
    tracking.finish()
    assert (sys.exit, sys.excepthook) == hooks  # wandb's hooks go with its run (they make sys.exit() exit 0)
    assert list((wandb_offline / "tb").glob("events.out.tfevents.*"))
    runs = list((wandb_offline / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_sft_logs_to_wandb_offline_beside_tensorboard(run_cli, wandb_offline):
    rc, _, err = run_cli("sft", "sft.max_steps=1", "device.threads=1", "data.max_rows=64", EVAL_ROWS,
                         "logging.report_to=[tensorboard,wandb]", timeout=900)
    assert rc == 0, err[-3000:]
    assert list((wandb_offline / "runs" / "tiny" / "sft" / "tensorboard").rglob("events.out.tfevents.*"))
    runs = list((wandb_offline / "runs" / "tiny" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
