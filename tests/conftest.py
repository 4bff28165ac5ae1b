"""Test-suite wide setup: the ``slow`` marker, applied where a test starts processes.

Two lanes (docs/contributing.md)::

    python -m pytest -m "not slow" -q     # fast lane: in-process unit tests, well under 2 minutes
    python -m pytest -q                   # everything (scripts/test.sh): multi-process, torchrun, drains

A test is marked ``slow`` when it, a same-module helper it calls or a same-module fixture it
uses refers to something that starts processes: :data:`PROCESS_NAMES` (``subprocess``,
``sys.executable``, multiprocessing, the drain server's ``wait_idle``/``server_pid``...), a
``torchrun`` command line, or a public function of the folder's helper modules that does
(``mp_utils.run_ranks``, ``fault_harness.run_trial``/``phases_reached``...). Whole modules of
end-to-end tests are listed in :data:`SLOW_MODULES`, single tests the scan cannot see in
:data:`SLOW_TESTS`. An explicit ``@pytest.mark.slow`` still works. The scan reads each module's source
once (``ast``); nothing is imported or run for it.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

# Names whose use means "this starts another process".
PROCESS_NAMES = frozenset({
    # tests/mp_utils.py and tests/fault_harness.py
    "run_ranks", "run_until_death", "run_group", "run_trial", "GroupRun",
    # launching processes directly
    "subprocess", "Popen", "executable", "spawn", "start_processes", "ProcessPoolExecutor", "fork", "Process",
    "get_context",
    # the persistent tier's detached drain server
    "wait_idle", "server_pid", "drain_status", "ensure_server",
})
# Strings in a test that mean the same (command lines).
PROCESS_STRINGS = ("torchrun",)
# Modules that are end-to-end by design: every test in them is slow.
SLOW_MODULES = frozenset({"test_e2e_torchrun.py"})
# "module.py::test_name" of tests that start processes the scan cannot see (e.g. through
# library code: a file:// persistent store starts a detached drain server).
SLOW_TESTS: frozenset[str] = frozenset()


def _references(node: ast.AST) -> set[str]:
    """The identifiers and attribute names a function (or fixture) body and decorators use."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            if any(s in sub.value for s in PROCESS_STRINGS):
                out.add("torchrun")
        elif isinstance(sub, ast.keyword) and sub.arg == "start_method":
            out.add("spawn")
    return out


@cache
def _process_functions(path: str, starters: frozenset[str]) -> frozenset[str]:
    """Names of the module's functions (tests, helpers, fixtures) that start processes, directly or not."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return frozenset()
    refs: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            refs[node.name] = _references(node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    refs[f"{node.name}.{sub.name}"] = _references(sub)
    # Module-level names bound to process starters (e.g. ``_run = functools.partial(run_ranks, ...)``).
    for node in tree.body:
        if isinstance(node, ast.Assign) and _references(node.value) & starters:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    refs[target.id] = set(starters)
    slow = {name for name, used in refs.items() if used & starters or "torchrun" in used}
    changed = True
    while changed:  # a helper calling a slow helper is slow
        changed = False
        for name, used in refs.items():
            if name not in slow and used & slow:
                slow.add(name)
                changed = True
    return frozenset(slow)


@cache
def _helper_starters(folder: str) -> frozenset[str]:
    """Public functions of the test folder's helper modules (mp_utils, fault_harness...) that start processes."""
    out: set[str] = set()
    for helper in sorted(Path(folder).glob("*.py")):
        if not helper.name.startswith(("test_", "conftest")):
            out.update(n for n in _process_functions(str(helper), PROCESS_NAMES)
                       if not n.startswith("_") and "." not in n and n != "main")
    return frozenset(out)


def _is_slow(item: pytest.Item) -> bool:
    path = Path(str(item.fspath))
    if path.name in SLOW_MODULES or f"{path.name}::{item.name.split('[')[0]}" in SLOW_TESTS:
        return True
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    slow = _process_functions(str(path), PROCESS_NAMES | _helper_starters(str(path.parent)))
    cls = getattr(item, "cls", None)
    name = f"{cls.__name__}.{fn.__name__}" if cls is not None else fn.__name__
    if name in slow:
        return True
    return any(f in slow for f in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start processes ``slow`` (see the module docstring)."""
    for item in items:
        if item.get_closest_marker("slow") is None and _is_slow(item):
            item.add_marker(pytest.mark.slow)
