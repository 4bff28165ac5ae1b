"""The rules that keep gemini_dcp's layers apart, checked from the source (no processes, ~1 s).

docs/architecture.md states them; this file is where they are enforced:
- no import cycle between the package's modules (function-local imports included: a local
  import is no way around a cycle);
- the restore decision and the placement are pure (no torch.distributed, no I/O modules);
- the tiers (``core``, ``local``, ``peer``, ``persistent``, ``transport``) never import the save
  and restore engines (``save``, ``restore``), the DCP adapters, the async path, the operator
  library, the trainer integrations or the CLI;
- the engines sit below the adapters: ``save`` and ``restore`` import neither each other nor
  anything of ``dcp``, ``snapshot``, ``ops``, ``integrations`` or the CLI;
- nothing imports the trainer integrations, and they import a trainer only inside functions;
- only ``gemini_dcp/transport/`` touches torch.distributed point-to-point;
- ``import gemini_dcp``, ``gemini_dcp.errors``, the options tree and the drain server import no torch;
- one import path per module: no alias finder for the package's old flat names;
- docs/architecture.md lists every module of the package and of the CLI, and benchmarks/README.md
  every benchmark script.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gemini_dcp"
TIERS = ("core", "local", "peer", "persistent", "transport")
ENGINES = ("gemini_dcp.save", "gemini_dcp.restore")
ADAPTERS = ("gemini_dcp.dcp", "gemini_dcp.snapshot", "gemini_dcp.ops", "gemini_dcp.integrations", "gemini_dcp_cli")
ABOVE_TIERS = ENGINES + ADAPTERS


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str) -> set[str]:
    """The package modules ``name`` imports anywhere (module level or in a function), TYPE_CHECKING aside."""
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node.level, node.module)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("gemini_dcp"):
                out.add(t)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def _without_faces(cycles: list[list[str]]) -> list[list[str]]:
    """Drop loops that close only through a package face (``pkg/__init__`` re-exporting its own
    submodules, which import a sibling through it): no module's code waits on another's there."""
    out = []
    for comp in cycles:
        members = set(comp)
        inner = {m: {t for t in GRAPH[m] & members
                     if not (_is_package(m) and t.startswith(m + "."))} for m in comp}
        seen: set[str] = set()

        def reach(v: str) -> None:
            for w in inner[v]:
                if w not in seen:
                    seen.add(w)
                    reach(w)

        if any((seen.clear(), reach(m), m in seen)[2] for m in comp):
            out.append(comp)
    return out


def test_no_import_cycle() -> None:
    assert _without_faces(_cycles()) == []


@pytest.mark.parametrize("name", ["gemini_dcp.core.restore_order", "gemini_dcp.peer.placement"])
def test_decisions_are_pure(name: str) -> None:
    text = MODULES[name].read_text()
    assert "torch.distributed" not in text.replace("torch.distributed.checkpoint", "")
    assert GRAPH[name] <= {"gemini_dcp.errors"}, GRAPH[name]


def test_tiers_never_import_the_layers_above() -> None:
    bad = {
        (m, t)
        for m in GRAPH
        if m.split(".")[1:2] and m.split(".")[1] in TIERS
        for t in GRAPH[m]
        if t.startswith(ABOVE_TIERS)
    }
    assert bad == set()


def test_the_engines_sit_below_the_adapters() -> None:
    bad = {
        (m, t)
        for m in GRAPH
        if m.startswith(ENGINES)
        for t in GRAPH[m]
        if t.startswith(ADAPTERS) or (t.startswith(ENGINES) and t.split(".")[1] != m.split(".")[1])
    }
    assert bad == set()


def test_integrations_sit_on_top() -> None:
    """Trainer integrations (``gemini_dcp.integrations``) sit above the DCP adapters: nothing else imports them,
    and they name a trainer (torchtitan, Lightning, Accelerate) only inside functions, so ``import gemini_dcp``
    never needs it."""
    users = sorted(m for m in GRAPH if not m.startswith("gemini_dcp.integrations")
                   for t in GRAPH[m] if t.startswith("gemini_dcp.integrations"))
    assert users == []
    for name, path in MODULES.items():
        if name.startswith("gemini_dcp.integrations"):
            top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
            for trainer in ("torchtitan", "lightning", "accelerate"):
                assert not any(re.search(rf"\b{trainer}\b", ast.unparse(n)) for n in top), (name, trainer)


def test_only_the_transport_touches_point_to_point() -> None:
    p2p = re.compile(r"\b(isend|irecv|batch_isend_irecv|P2POp)\b")
    users = sorted(
        name for name, path in MODULES.items()
        if not name.startswith("gemini_dcp.transport") and p2p.search(path.read_text())
    )
    assert users == []


def test_light_modules_import_no_torch() -> None:
    light = ["gemini_dcp", "gemini_dcp.errors", "gemini_dcp.options", "gemini_dcp.options.env"]
    light += [m for m in MODULES if m.startswith("gemini_dcp.persistent.drain") and m.endswith(("server", "request"))]
    code = "import sys\n" + "".join(f"import {m}\n" for m in light) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"{light} pulled in torch"


def test_one_name_per_module_no_alias_layer() -> None:
    """A module has one import path: no meta-path finder maps the package's old flat names."""
    import importlib.util

    import gemini_dcp

    for old in ("writer", "reader", "records", "comm", "checksum", "drain", "stock", "layout"):
        assert importlib.util.find_spec(f"gemini_dcp.{old}") is None, old
        with pytest.raises(AttributeError):
            getattr(gemini_dcp, old)
    assert not any(type(f).__module__.startswith("gemini_dcp") for f in sys.meta_path)
    assert gemini_dcp.GeminiStorageWriter is importlib.import_module("gemini_dcp.dcp.writer").GeminiStorageWriter
    assert gemini_dcp.AsyncCheckpointer is importlib.import_module("gemini_dcp.snapshot").AsyncCheckpointer


def test_every_module_is_listed_in_the_architecture_doc() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    files = sorted([*PKG.rglob("*.py"), *(REPO / "cli").rglob("*.py")])
    missing = [str(p.relative_to(REPO)) for p in files if f"`{p.relative_to(REPO).as_posix()}`" not in doc]
    assert missing == [], f"docs/architecture.md does not list {missing} (one line on each module's job)"
    listed = set(re.findall(r"`((?:gemini_dcp|cli)/[\w/]+\.py)`", doc))
    gone = sorted(p for p in listed if not (REPO / p).exists())
    assert gone == [], f"docs/architecture.md lists modules that do not exist: {gone}"


def test_every_benchmark_script_is_listed_in_its_readme() -> None:
    readme = (REPO / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (REPO / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert [s for s in scripts if f"`{s}`" not in readme] == []


def test_no_module_imports_a_private_name_of_another() -> None:
    """A seam between two modules has public names: ``from .x import _y`` means the two are one unit
    (merge them) or the name is the seam (make it public)."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gemini_dcp")):
                found += [f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == ["gemini_dcp.local.launch_lock: _warn_once"]  # launch_lock is being reworked on its own branch
