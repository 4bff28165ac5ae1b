"""Which torch releases gemini_dcp supports, and which of them have a known-good torchrec.

The supported range has one source of truth: the ``torch`` requirement in pyproject.toml,
as recorded in the installed package's metadata (``importlib.metadata.requires``).
``gemini-dcp doctor`` and ``scripts/install.sh`` read it from there; neither holds a copy.
When the package is not installed yet (install.sh before its ``pip install -e``), the
requirement is read from the pyproject.toml next to this file, the file the metadata is
built from.

This module imports nothing from torch or from the rest of the package, so it works
before torch is installed and runs as a script (``python gemini_dcp/torch_support.py``)
without importing ``gemini_dcp``::

    python gemini_dcp/torch_support.py range             # >=2.7,<2.16
    python gemini_dcp/torch_support.py check 2.15.0      # exit 0 if supported, else 1 and why
    python gemini_dcp/torch_support.py check-installed   # the same for the installed torch
    python gemini_dcp/torch_support.py torchrec 2.14.1   # FBGEMM TORCHREC TENSORDICT, or nothing
    python gemini_dcp/torch_support.py torchrec-support  # "2.7, 2.9-2.14"
    python gemini_dcp/torch_support.py stale             # exit 0 if the installed metadata's range differs from pyproject.toml

``check`` and ``check-installed`` test against this tree's pyproject.toml when the installed
metadata is absent or stale: that is the requirement the coming ``pip install -e .`` installs.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import operator
import re
import sys
from collections.abc import Callable
from pathlib import Path

try:
    from ..errors import ConfigError
except ImportError:  # run as a script (install.sh, possibly before torch is installed): no package context

    class ConfigError(ValueError):  # type: ignore[no-redef]
        """Stands in for gemini_dcp.errors.ConfigError outside the package."""


__all__ = [
    "DIST_NAME",
    "TORCHREC_PAIRINGS",
    "TorchRequirement",
    "installed_torch_version",
    "pyproject_torch_requirement",
    "torch_requirement",
    "torchrec_pairing",
    "torchrec_support",
]

DIST_NAME = "gemini-dcp"

#: torch minor -> (fbgemm-gpu-cpu, torchrec, tensordict requirement): the CPU stacks whose torchrec
#: tests passed here (scripts/install.sh installs them; docs/compat.md lists the runs). None known
#: for torch 2.8 and 2.15: fbgemm-gpu-cpu's newest served build (1.9.0) is built for 2.14, and
#: torchrec 1.9.x on torch 2.15 fails to load fbgemm's ops (OSError from fbgemm_gpu_py.so).
TORCHREC_PAIRINGS: dict[str, tuple[str, str, str]] = {
    "2.7": ("1.2.0", "1.2.0", "tensordict==0.8.3"),
    "2.9": ("1.4.2", "1.4.0", "tensordict==0.10.0"),
    "2.10": ("1.5.0", "1.5.1", "tensordict==0.11.0"),
    "2.11": ("1.6.0", "1.6.1", "tensordict"),
    "2.12": ("1.7.0", "1.7.0", "tensordict"),
    "2.13": ("1.8.0", "1.8.0", "tensordict"),
    "2.14": ("1.9.0", "1.9.0", "tensordict"),
}

_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")
_CLAUSE = re.compile(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.*+!_-]*)\s*$")
_OPS: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}


def _release(version: str) -> tuple[int, ...]:
    """``'2.15.0+cu130'`` -> ``(2, 15, 0)``; ``'2.16.0a0'`` -> ``(2, 16, 0)`` (the numeric release part)."""
    out: list[int] = []
    for part in version.split("+")[0].split("."):
        m = re.match(r"[0-9]+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):  # '0a0', '0rc1': a pre-release ends the release part
            break
    return tuple(out)


def _pad(a: tuple[int, ...], n: int) -> tuple[int, ...]:
    return a + (0,) * (n - len(a))


class TorchRequirement:
    """The ``torch`` requirement of gemini-dcp: ``str()`` is the specifier (``'>=2.7,<2.16'``),
    :meth:`admits` tests a version; parsed with ``packaging`` when it is installed, else by a
    small parser of comma-separated comparison clauses (what pyproject.toml uses)."""

    def __init__(self, specifier: str, source: str) -> None:
        self.specifier = specifier.strip()
        self.source = source  # "metadata of gemini-dcp 0.1.0" or "…/pyproject.toml"
        self._clauses: list[tuple[str, str]] = []
        for clause in filter(None, (c.strip() for c in self.specifier.split(","))):
            m = _CLAUSE.match(clause)
            if m is None:
                raise ConfigError(f"torch requirement {self.specifier!r} ({source}): cannot parse {clause!r}; "
                                  "fix the torch entry of pyproject.toml's dependencies and reinstall (pip install -e .)")
            self._clauses.append((m.group(1), m.group(2)))
        try:
            from packaging.specifiers import SpecifierSet  # noqa: PLC0415

            self._spec: SpecifierSet | None = SpecifierSet(self.specifier)
        except ImportError:
            self._spec = None

    def __str__(self) -> str:
        # The order people write: lower bound first (metadata normalizes '>=2.7,<2.16' to '<2.16,>=2.7').
        return ",".join(op + v for op, v in sorted(self._clauses, key=lambda c: (c[0][0] != ">", c[0])))

    def __repr__(self) -> str:
        return f"TorchRequirement({str(self)!r}, source={self.source!r})"

    def admits(self, version: str) -> bool:
        """Whether torch ``version`` (``'2.15.0'``, ``'2.15.0+cu130'``) satisfies the requirement."""
        if self._spec is not None:
            return self._spec.contains(version.split("+")[0], prereleases=True)
        have = _release(version)
        for op, want in self._clauses:
            if op == "~=":
                w = _release(want)
                n = max(len(w), len(have))
                if not (_pad(have, n) >= _pad(w, n) and have[: len(w) - 1] == w[:-1]):
                    return False
            elif want.endswith(".*") and op in ("==", "!="):
                prefix = _release(want[:-2])
                if (have[: len(prefix)] == prefix) != (op == "=="):
                    return False
            else:
                w = _release(want)
                n = max(len(w), len(have))
                if not _OPS["==" if op == "===" else op](_pad(have, n), _pad(w, n)):
                    return False
        return True

    def pip_spec(self) -> str:
        """``torch>=2.7,<2.16``: what to give pip."""
        return f"torch{self}"


def _torch_clause(requirement: str) -> str | None:
    """The version specifier of ``requirement`` if it names torch unconditionally (no extra), else None."""
    req, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    m = _REQ_NAME.match(req)
    if m is None or m.group(1).lower() != "torch":
        return None
    return m.group(2).strip().strip("()").strip()


def pyproject_torch_requirement(pyproject: Path | None = None) -> TorchRequirement:
    """The torch requirement in the source tree's pyproject.toml (the file the metadata is built from)."""
    path = pyproject or Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"gemini-dcp is not installed and {path} cannot be read ({exc}): "
                          "install the package (pip install -e .) from its source tree") from exc
    try:
        import tomllib  # noqa: PLC0415 - Python >= 3.11

        deps = list(tomllib.loads(text).get("project", {}).get("dependencies", []))
    except ImportError:  # Python 3.10: the strings of the [project] dependencies array
        m = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
        deps = re.findall(r"\"([^\"]+)\"|'([^']+)'", m.group(1)) if m else []
        deps = [a or b for a, b in deps]
    for dep in deps:
        spec = _torch_clause(dep)
        if spec is not None:
            return TorchRequirement(spec, str(path))
    raise ConfigError(f"{path} has no torch requirement in [project] dependencies")


def torch_requirement() -> TorchRequirement:
    """The torch requirement from the installed gemini-dcp's metadata; pyproject.toml when it
    is not installed. Raises :class:`~gemini_dcp.errors.ConfigError` (with what to do) when neither has one."""
    try:
        requires = _metadata.requires(DIST_NAME) or []
        version = _metadata.version(DIST_NAME)
    except _metadata.PackageNotFoundError:
        return pyproject_torch_requirement()
    for dep in requires:
        spec = _torch_clause(dep)
        if spec is not None:
            return TorchRequirement(spec, f"metadata of {DIST_NAME} {version}")
    raise ConfigError(f"the installed {DIST_NAME} {version} declares no torch requirement: reinstall it "
                      "(pip install -e . in its source tree)")


def installed_torch_version() -> str | None:
    """The installed torch's version from its distribution metadata (torch is not imported); None if absent."""
    try:
        return _metadata.version("torch")
    except _metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> str:
    return ".".join(str(x) for x in _release(version)[:2])


def torchrec_pairing(torch_version: str) -> tuple[str, str, str] | None:
    """(fbgemm-gpu-cpu, torchrec, tensordict requirement) known to work with ``torch_version``; None if none is known."""
    return TORCHREC_PAIRINGS.get(_minor(torch_version))


def torchrec_support() -> str:
    """The torch minors with a known-good torchrec, as ranges: ``'2.7, 2.9-2.14'``."""
    minors = sorted(_release(m) for m in TORCHREC_PAIRINGS)
    runs: list[list[tuple[int, ...]]] = []
    for m in minors:
        if runs and runs[-1][-1][0] == m[0] and runs[-1][-1][1] + 1 == m[1]:
            runs[-1].append(m)
        else:
            runs.append([m])
    fmt = lambda v: ".".join(map(str, v))  # noqa: E731
    return ", ".join(fmt(r[0]) if len(r) == 1 else f"{fmt(r[0])}-{fmt(r[-1])}" for r in runs)


def _installed_is_stale() -> bool:
    """Whether the installed gemini-dcp's torch requirement differs from this source tree's pyproject.toml
    (an install from before the range changed; ``pip install -e .`` refreshes it). False when not installed."""
    try:
        _metadata.requires(DIST_NAME)
    except _metadata.PackageNotFoundError:
        return False
    return str(torch_requirement()) != str(pyproject_torch_requirement())


def _script_requirement() -> TorchRequirement:
    """For install.sh: the installed metadata's requirement, or this tree's pyproject.toml when the
    metadata is absent or stale (the requirement the coming ``pip install -e .`` will install)."""
    return pyproject_torch_requirement() if _installed_is_stale() else torch_requirement()


def _check(version: str | None, *, installed: bool) -> int:
    req = _script_requirement()
    if version is None:
        print(f"torch is not installed; gemini-dcp needs {req.pip_spec()} ({req.source})", file=sys.stderr)
        return 1
    if req.admits(version):
        return 0
    what = f"torch {version} is outside gemini-dcp's supported range {req} ({req.source})"
    if installed:
        what += (": installing gemini-dcp here would make pip replace it. Use a torch that satisfies it "
                 f"(pip install '{req.pip_spec()}'), or give gemini-dcp its own venv")
    print(what, file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "range"
    try:
        if cmd == "range":
            print(torch_requirement())
        elif cmd == "check" and len(argv) == 2:
            return _check(argv[1], installed=False)
        elif cmd == "check-installed":
            return _check(installed_torch_version(), installed=True)
        elif cmd == "torchrec" and len(argv) == 2:
            pairing = torchrec_pairing(argv[1])
            if pairing is not None:
                print(*pairing)
        elif cmd == "torchrec-support":
            print(torchrec_support())
        elif cmd == "stale":
            return 0 if _installed_is_stale() else 1
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ValueError as exc:
        print(f"torch_support: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
