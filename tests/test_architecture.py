"""The rules that keep gemini_dcp's layers apart, checked from the source (no processes, ~1 s).

docs/architecture.md states them; this file is where they are enforced:
- no import cycle between the package's modules (function-local imports included: a local
  import is no way around a cycle);
- the restore decision and the placement are pure (no torch.distributed, no I/O modules);
- the tiers (``core``, ``local``, ``peer``, ``persistent``, ``transport``) never import the DCP
  adapters, the async path, the operator library, the trainer integrations or the CLI;
- nothing imports the trainer integrations, and they import a trainer only inside functions;
- only ``gemini_dcp/transport/`` touches torch.distributed point-to-point;
- ``import gemini_dcp``, ``gemini_dcp.errors``, the options tree and the drain server import no torch;
- a module over 500 lines says why at its top (a ``Size:`` line in its docstring);
- every old flat import path still resolves, to the same module object as its new home.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gemini_dcp"
TIERS = ("core", "local", "peer", "persistent", "transport")
ABOVE_TIERS = ("gemini_dcp.dcp", "gemini_dcp.snapshot", "gemini_dcp.ops", "gemini_dcp.integrations", "gemini_dcp_cli")
MAX_LINES = 500


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


def test_long_modules_say_why() -> None:
    silent = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Size:" not in doc:
                silent.append(f"{name} ({text.count(chr(10))} lines)")
    assert silent == []


def test_old_import_paths_resolve_to_the_new_modules() -> None:
    from gemini_dcp._aliases import OLD_MODULES

    for old, new in OLD_MODULES.items():
        assert importlib.import_module(f"gemini_dcp.{old}") is importlib.import_module(f"gemini_dcp.{new}"), old
    import gemini_dcp

    assert gemini_dcp.GeminiStorageWriter is importlib.import_module("gemini_dcp.dcp.writer").GeminiStorageWriter
    assert gemini_dcp.AsyncCheckpointer is importlib.import_module("gemini_dcp.snapshot").AsyncCheckpointer
