"""Old import paths of the flat package, kept working after the move into subpackages.

``import gemini_dcp.writer`` (and ``from gemini_dcp import records`` and the like) resolve to
the module at its new place: the *same* module object, so ``monkeypatch`` and ``isinstance``
see one identity. Pickles that name an old module path resolve through :data:`OLD_MODULES` too
(see :mod:`gemini_dcp.core.safe_pickle`). Nothing here imports torch until an alias is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

# old module (under gemini_dcp) -> its new dotted path (under gemini_dcp)
OLD_MODULES: dict[str, str] = {
    "adopt": "persistent.adopt",
    "checksum": "core.checksum",
    "comm": "transport.comm",
    "compat": "core.compat",
    "config": "core.config",
    "costmodel": "ops.costmodel",
    "doctor": "ops.doctor",
    "drain": "persistent.drain",
    "export": "persistent.export",
    "faults": "core.faults",
    "gpuinfo": "ops.gpuinfo",
    "housekeeping": "ops.housekeeping",
    "inspect": "ops.inspection",
    "interleave": "snapshot.interleave",
    "job_files": "local.job_files",
    "launch": "core.launch",
    "layout": "local.job_dir",
    "local_tier": "local.tier",
    "placement": "peer.placement",
    "plan_replay": "snapshot.replay",
    "reader": "dcp.reader",
    "records": "local.records",
    "restore_plan": "core.restore_order",
    "safe_pickle": "core.safe_pickle",
    "slots": "local.slots",
    "stock": "persistent.stock_format",
    "tier_plan": "ops.sizing",
    "torch_support": "core.torch_support",
    "verify": "ops.verify",
    "writer": "dcp.writer",
}
# Old names that are now packages: ``gemini_dcp.peer``/``persistent``/``snapshot``/``ext`` keep
# their public names at the package face, so they need no alias.

_PREFIX = "gemini_dcp."


def new_module_name(old: str) -> str:
    """The module path that replaced ``old`` (a full dotted name), or ``old`` itself."""
    if old.startswith(_PREFIX):
        tail = OLD_MODULES.get(old[len(_PREFIX):])
        if tail is not None:
            return _PREFIX + tail
    return old


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system overwrote it with the alias's spec
        module.__loader__ = self._spec.loader if self._spec is not None else module.__loader__


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_module_name(fullname)
        if new == fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def forward_to(package: str, module: str) -> Callable[[str], Any]:
    """A package face's ``__getattr__`` resolving the names of the flat module the package replaced
    (``gemini_dcp.peer.replicate`` -> ``gemini_dcp.peer.replication.replicate``), imported on first use."""

    def __getattr__(name: str) -> Any:
        target = importlib.import_module(f"{package}.{module}")
        try:
            return getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
