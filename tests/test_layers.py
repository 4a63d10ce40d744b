"""The package's layers: an import (at module level or inside a function) goes to a module of the same or a lower
rank, never up, and no two modules import each other."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rlhf_cli"

# rank of each module (prefix match, longest first); a module may import modules of its own rank or lower
RANKS = {
    "rlhf_cli": 0, "rlhf_cli.errors": 0, "rlhf_cli.choices": 0, "rlhf_cli.accel.limits": 0, "rlhf_cli.stage_table": 0,
    "rlhf_cli.io": 1, "rlhf_cli.keys": 1, "rlhf_cli.schema": 1, "rlhf_cli.config": 1, "rlhf_cli.data": 1, "rlhf_cli.demo": 1,
    "rlhf_cli.tiny": 1, "rlhf_cli.launch": 1, "rlhf_cli.supervise": 1, "rlhf_cli.precision": 1,
    "rlhf_cli.gpu_memory": 1, "rlhf_cli.devices": 1, "rlhf_cli.identity": 1, "rlhf_cli.hints": 1,
    "rlhf_cli.run_logs": 1, "rlhf_cli.run_lock": 1, "rlhf_cli.quantization": 1, "rlhf_cli.hardware": 1,
    "rlhf_cli.settings": 1,
    "rlhf_cli.tracking": 2, "rlhf_cli.models": 2, "rlhf_cli.memory": 2, "rlhf_cli.resume": 2, "rlhf_cli.own_data": 2,
    "rlhf_cli.cards": 2, "rlhf_cli.learned": 2, "rlhf_cli.sources": 2, "rlhf_cli.optional": 3,
    "rlhf_cli.accel": 3, "rlhf_cli.ppo.core": 2,
    "rlhf_cli.ppo": 4,
    "rlhf_cli.stages": 5,
    "rlhf_cli.cli": 6, "rlhf_cli.recipes": 6, "rlhf_cli.keyhelp": 6, "rlhf_cli.multirun": 6, "rlhf_cli.accelerate_launch": 6,
}


def rank(mod: str) -> int:
    best = max((k for k in RANKS if mod == k or mod.startswith(k + ".")), key=len)
    return RANKS[best]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports() -> dict[str, set[str]]:
    mods, graph = modules(), {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_cli"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("rlhf_cli")}
        graph[name] = deps - {name}
    return graph


def test_every_module_has_a_rank():
    """Of its own: a module directly in the package is not ranked by the package's entry."""
    unranked = [m for m in modules() if m != "rlhf_cli"
                and not any(m == k or m.startswith(k + ".") for k in RANKS if k != "rlhf_cli")]
    assert not unranked, unranked


def test_no_upward_import():
    up = sorted(f"{m} -> {d}" for m, deps in imports().items() for d in deps
                if rank(d) > rank(m) and not m.startswith(d + "."))
    assert not up, up


def test_no_import_cycle():
    graph, cycles = imports(), []
    for a, deps in graph.items():
        cycles += [f"{a} <-> {b}" for b in deps if a < b and a in graph.get(b, ()) and not b.startswith(a + ".")
                   and not a.startswith(b + ".")]
    assert not cycles, cycles


def test_functions_stay_short_and_the_ppo_stage_small():
    """No function in the package over 80 lines; `rlhf ppo`'s stage (which assembles the run from the ppo package)
    at most 150 lines."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append((name, node.name, node.end_lineno - node.lineno + 1))
    assert not long
    assert len((PKG / "stages" / "ppo.py").read_text().splitlines()) <= 150


# modules over 500 lines, each with why it stays one module
LONG = {
    "rlhf_cli.ppo.rewards": "every source a score comes from (functions, servers, the ground-truth checker) shares "
                            "the loading, sandboxing and checks of user code",
    "rlhf_cli.ppo.trainer": "the PPO loop read top to bottom as numbered steps; its checkpoints are run_state's",
    "rlhf_cli.ppo.core": "pure tensor maths, each estimator and loss with its formula and reference",
}


def test_modules_stay_under_500_lines_or_say_why():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    long = sorted(f"{name}: {n}" for name, n in sizes.items() if n > 500 and name not in LONG)
    assert not long, long
    stale = sorted(name for name in LONG if sizes.get(name, 0) <= 500)
    assert not stale, f"no longer over 500 lines: {stale}"
