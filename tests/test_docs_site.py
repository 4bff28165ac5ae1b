"""The documentation site (mkdocs.yml): it builds with ``--strict``, and its reference covers the public API.

- ``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the nav, and a
  ``::: name`` the code does not have (mkdocstrings): the build runs here, into a temporary folder.
- mkdocstrings renders a name without a docstring silently, so the coverage is checked here: every name
  in the ``__all__`` of a public module (``PUBLIC_MODULES``: the package, options, snapshot, the framework
  integrations; every module the guide imports from must be one) and every class of ``gemini_dcp.errors``
  has a ``:::`` entry in ``docs/reference/`` (its own, or its module's) and a docstring of its own; every field of an options dataclass is described (its own docstring, or named in
  the class docstring); every ``gemini-dcp`` command is listed in ``docs/reference/cli.md`` and has a
  section in ``docs/cli.md``; every ``GEMINI_DCP_*`` variable the package reads is in
  ``docs/reference/environment.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference"


def directives() -> dict[str, list[str]]:
    """``::: target`` of every reference page -> its ``members: [...]`` (empty: the whole object)."""
    out: dict[str, list[str]] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", text, flags=re.M):
            members = re.search(r"members: \[([^\]]*)\]", m.group(2))
            out[m.group(1)] = [s.strip() for s in members.group(1).split(",")] if members else []
    return out


def _defined_in(module: str, name: str) -> str:
    """The module that defines ``module.name`` (the package's lazy names resolve to their modules)."""
    obj = getattr(importlib.import_module(module), name)
    return getattr(obj, "__module__", module) if _is_code(obj) else module


def _is_code(obj: object) -> bool:
    """A class or a function (a typing alias such as ``Literal[...]`` is callable, but a constant)."""
    return inspect.isclass(obj) or inspect.isroutine(obj)


def _covered(target: str, module: str, name: str, entries: dict[str, list[str]]) -> bool:
    home = _defined_in(module, name)
    for path in (f"{module}.{name}", f"{home}.{name}"):
        if path in entries:
            return True
    for mod in (module, home):  # a module-level entry: all its public members, or the listed ones
        if mod in entries and (not entries[mod] or name in entries[mod]):
            return True
    return False


# The modules a user imports from (the guide's snippets do): each one's ``__all__`` is its public API.
PUBLIC_MODULES = (
    "gemini_dcp", "gemini_dcp.options", "gemini_dcp.snapshot",
    "gemini_dcp.integrations.torchtitan", "gemini_dcp.integrations.lightning",
    "gemini_dcp.integrations.accelerate", "gemini_dcp.integrations.deepspeed", "gemini_dcp.integrations.resume",
)
# Names a module builds on first access (``__getattr__``: importing them imports the framework), each
# documented by the entry of the function that builds it.
LAZY = {("gemini_dcp.integrations.lightning", "GeminiModelParallelStrategy"): "strategy_class"}

PUBLIC = [(m, n) for m in PUBLIC_MODULES for n in importlib.import_module(m).__all__ if n != "__version__"]
# gemini_dcp.errors has no __all__: its public names are the classes and functions it defines.
PUBLIC += [
    ("gemini_dcp.errors", n) for n, obj in vars(importlib.import_module("gemini_dcp.errors")).items()
    if not n.startswith("_") and _is_code(obj) and getattr(obj, "__module__", "") == "gemini_dcp.errors"
]


def test_the_public_modules_are_the_ones_the_guide_imports_from() -> None:
    """A module the guide's snippets import names from is public: it must be in PUBLIC_MODULES (or be
    an internal module the guide shows on purpose, listed here)."""
    internal_shown = {  # docs/extension.md (an Internals page) lists gemini_dcp.ext's API itself
        "gemini_dcp.peer.placement", "gemini_dcp.ops.sizing", "gemini_dcp.local.tier", "gemini_dcp.ext",
    }
    imported = set()
    for page in [*(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        imported |= set(re.findall(r"^\s*from (gemini_dcp(?:\.\w+)*) import", page.read_text(), flags=re.M))
    unknown = sorted(imported - set(PUBLIC_MODULES) - {"gemini_dcp.errors"} - internal_shown)
    assert not unknown, f"the guide imports from {unknown}: add them to PUBLIC_MODULES (and the reference)"


def test_every_public_name_has_a_reference_entry_and_a_docstring() -> None:
    entries = directives()
    missing = [
        f"{m}.{n}" for m, n in PUBLIC
        if not _covered(f"{m}.{n}", m, LAZY.get((m, n), n), entries)
    ]
    assert not missing, f"no '::: name' entry in docs/reference/*.md for: {missing}"
    undocumented = []
    for module, name in PUBLIC:
        if (module, name) in LAZY:
            continue  # its builder's docstring (checked above through its entry) documents it
        obj = getattr(importlib.import_module(module), name)
        if _is_code(obj):
            if not (obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__):
                undocumented.append(f"{module}.{name}")
        else:  # a constant: its docstring is the string right after its assignment (griffe reads it)
            static = _static(module, name)
            if static is None or not static.docstring:
                undocumented.append(f"{module}.{name}")
    assert not undocumented, f"public names without a docstring: {undocumented}"


@functools.cache
def _package():  # type: ignore[no-untyped-def]
    """griffe's static view of the package (what mkdocstrings renders)."""
    griffe = pytest.importorskip("griffe")
    return griffe.load("gemini_dcp", search_paths=[str(REPO)], resolve_aliases=False)


def _static(module: str, name: str):  # type: ignore[no-untyped-def]
    """griffe's view of ``module.name`` (an import followed to its definition)."""
    pkg = _package()
    obj = pkg[module.removeprefix("gemini_dcp").lstrip(".")][name] if module != "gemini_dcp" else pkg[name]
    while obj.is_alias:
        obj = pkg[obj.target_path.removeprefix("gemini_dcp.")]
    return obj


def test_every_option_field_is_described() -> None:
    options = importlib.import_module("gemini_dcp.options")
    bare = []
    for name in options.__all__:
        cls = getattr(options, name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        doc = cls.__doc__ or ""
        static = _static("gemini_dcp.options", name)
        for f in dataclasses.fields(cls):
            member = static.members.get(f.name)
            if f.name not in doc and not (member is not None and member.docstring):
                bare.append(f"{name}.{f.name}")
    assert not bare, f"option fields described neither by a docstring nor in their class docstring: {bare}"


def test_every_cli_command_is_in_the_reference_and_the_guide() -> None:
    main = importlib.import_module("gemini_dcp_cli.main")
    listed = directives().get("gemini_dcp_cli.main", [])
    guide = (REPO / "docs" / "cli.md").read_text()
    for cmd in main.app.registered_commands:
        fn = cmd.callback
        assert fn.__name__ in listed, f"gemini-dcp {cmd.name}: add {fn.__name__} to docs/reference/cli.md's members"
        assert fn.__doc__, f"gemini-dcp {cmd.name}: {fn.__name__} has no docstring (its --help text)"
        assert re.search(rf"^## `{cmd.name}`", guide, flags=re.M), f"docs/cli.md has no '## `{cmd.name}`' section"


def test_every_environment_variable_is_documented() -> None:
    page = (REFERENCE / "environment.md").read_text()
    read = set()
    for src in (REPO / "gemini_dcp").rglob("*.py"):
        read |= set(re.findall(r"GEMINI_DCP_[A-Z0-9_]*[A-Z0-9]\b", src.read_text()))
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"docs/reference/environment.md does not list: {missing}"


@pytest.mark.timeout(300)
def test_site_builds_strict(tmp_path: Path) -> None:
    """The whole site, as CI builds it: a broken link, anchor or reference entry fails."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: `pip install -e '.[test]'` (scripts/install.sh does)")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=280, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert (tmp_path / "site" / "reference" / "storage" / "index.html").exists()


def _expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for part in m.group(1).split(",") for x in _expand_braces(pattern[: m.start()] + part + pattern[m.end():])]


def test_every_results_file_is_cited() -> None:
    """benchmarks/results/ holds only what the docs cite: each file by its name, or in a brace list the
    docs give (``recovery-optinit-{before,after}-{1,2,3}.json``). A wildcard (``async-*.json``) cites no
    file: each figure names its own file, and a file no figure names goes (its history stays in git)."""
    text = "".join(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))
    text += (REPO / "README.md").read_text() + (REPO / "benchmarks" / "README.md").read_text()
    text += (REPO / "benchmarks" / "gate.py").read_text()  # the gate's own history
    cited = {Path(x).name for tok in re.findall(r"[\w{},*./-]+\.jsonl?", text) for x in _expand_braces(tok)}
    uncited = [p.name for p in sorted((REPO / "benchmarks" / "results").iterdir())
               if p.is_file() and p.suffix != ".lock" and p.name not in cited]
    assert not uncited, f"benchmarks/results/ files no doc cites (cite them, or git rm them): {uncited}"


def test_the_front_page_links_the_three_first_answers() -> None:
    """From docs/index.md a newcomer reaches, in one click each: adding gemini_dcp to a loop, resuming,
    and choosing replicas or parity (the strict build checks that the anchors exist)."""
    front = (REPO / "docs" / "index.md").read_text()
    for target in ("getting-started.md#add-it-to-your-loop", "getting-started.md#resume", "concepts.md#replicas-or-parity"):
        assert f"]({target})" in front, f"docs/index.md does not link {target}"
    readme = (REPO / "README.md").read_text()
    assert "mkdocs serve" in readme and "docs/index.md" in readme, "README: link the site and say how to build it"
