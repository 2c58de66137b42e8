"""The parts of adaptipe import only downward, in the order of `LAYERS`.

docs/architecture.md explains the order: each part follows the data from the one below
it (a profile feeds a plan, a plan a schedule, a schedule the simulator, ...), so a part
can be read, tested and replaced with only the parts below it. Every import counts: at
module level, inside a function, and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first; parts on one line may import each other.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "serial", "units"),
    ("netbed",),
    ("models",),
    ("profile",),
    ("plan",),
    ("schedule",),
    ("sim",),
    ("japsp",),
    ("cluster",),
    ("monitor",),
    ("inject",),
    ("runtime",),
    ("controllers",),
    ("envs",),
    ("cli", "demo", "adaptive_demo", "timeslice"),
]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}
# `adaptipe/__init__.py` re-exports Partition, Profile and Schedule: it sits with the
# highest part it imports, so only parts at or above schedule may `import adaptipe`.
PACKAGE_LEVEL = LEVEL["schedule"]

# Source folders and the packages they install as (pyproject's package-dir).
SOURCES = {
    "adaptipe": "adaptipe",
    "models": "adaptipe.models",
    "controllers": "adaptipe.controllers",
    "envs": "adaptipe.envs",
}
SOLVER_MODULES = ("bnb", "cpsat", "genetic", "local_search", "solve", "window")


def _modules() -> Iterator[tuple[Path, str]]:
    """Every source file and its dotted module name."""
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield path, ".".join((package, *parts))


def _part(module: str) -> str | None:
    """The part of an ``adaptipe`` module (``adaptipe.sim.dag`` -> ``sim``); "" for the
    package itself; None outside adaptipe."""
    names = module.split(".")
    if names[0] != "adaptipe":
        return None
    return names[1] if len(names) > 1 else ""


def _level(part: str) -> int:
    return PACKAGE_LEVEL if part == "" else LEVEL[part]


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for every import in the file, wherever it is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base == "adaptipe":  # `from adaptipe import sim` names a part
                for alias in node.names:
                    name = f"adaptipe.{alias.name}"
                    yield node.lineno, name if alias.name in LEVEL else base
            else:
                yield node.lineno, base
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _upward(path: Path, module: str) -> list[str]:
    """``file:line: part -> imported module`` for each import of a higher part."""
    part = _part(module)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    assert part is not None and (part == "" or part in LEVEL), (
        f"{where}: part {part!r} is not in LAYERS; add it where it belongs"
    )
    found: list[str] = []
    for line, imported in _imports(path, module):
        target = _part(imported)
        if target is None:
            continue
        assert target == "" or target in LEVEL, (
            f"{where}:{line}: imports {imported}, whose part is not in LAYERS"
        )
        if _level(target) > _level(part):
            found.append(f"{where}:{line}: {part or 'adaptipe'} -> {imported}")
    return found


def test_no_part_imports_a_part_above_it() -> None:
    found = [line for path, module in _modules() for line in _upward(path, module)]
    assert not found, "upward imports (see docs/architecture.md):\n" + "\n".join(found)


def _loaded_after(statement: str) -> list[str]:
    """The adaptipe modules a fresh interpreter holds after running ``statement``."""
    code = (
        f"import json, sys\n{statement}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('adaptipe'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_importing_the_stage_executor_loads_no_japsp_solver() -> None:
    loaded = _loaded_after("import adaptipe.runtime.stage")
    solvers = [m for m in loaded if m in {f"adaptipe.japsp.{s}" for s in SOLVER_MODULES}]
    assert not solvers, f"import adaptipe.runtime.stage loads JAPSP solvers: {solvers}"


def test_profile_modules_load_neither_runtime_nor_monitor() -> None:
    names = sorted(m for _, m in _modules() if _part(m) == "profile")
    loaded = _loaded_after("\n".join(f"import {m}" for m in names))
    above = [m for m in loaded if _part(m) in ("runtime", "monitor")]
    assert not above, f"importing {', '.join(names)} loads {above}"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "adaptipe.profile.x",
            "from adaptipe.runtime.wgrad import A\n",
            "profile -> adaptipe.runtime.wgrad",
        ),
        (
            "adaptipe.sim.x",
            "def f():\n    import adaptipe.japsp.solve\n",
            "sim -> adaptipe.japsp.solve",
        ),
        (
            "adaptipe.sim.x",
            "if TYPE_CHECKING:\n    from adaptipe.cli import main\n",
            "sim -> adaptipe.cli",
        ),
        ("adaptipe.plan.x", "from ..sim import dag\n", "plan -> adaptipe.sim"),
        ("adaptipe.sim.x", "from adaptipe import cli\n", "sim -> adaptipe.cli"),
        ("adaptipe.models", "from adaptipe import Profile\n", "models -> adaptipe"),
        (
            "adaptipe.models.x",
            "importlib.import_module('adaptipe.plan.api')\n",
            "models -> adaptipe.plan.api",
        ),
    ],
)
def test_the_walk_finds_each_kind_of_upward_import(
    tmp_path: Path, module: str, source: str, expected: str
) -> None:
    path = tmp_path / ("__init__.py" if module == "adaptipe.models" else "x.py")
    path.write_text(source)
    assert _upward(path, module) == [f"{path}:{source.count(chr(10))}: {expected}"]
