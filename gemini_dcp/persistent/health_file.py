"""A persisted step's health (:mod:`gemini_dcp.health`), beside the stock DCP layout.

The drain writes ``.gemini/health.json`` before the step's ``.metadata`` (the commit) when its
step record was health-checked: ``{"healthy": bool, "nonfinite": [[rank, fqn, count], ...]}``.
Stock DCP never reads ``.gemini/``, so the step stays stock-readable; a step without the file
(written without the check, or by an older release) counts as healthy. JSON, never a pickle.
"""

from __future__ import annotations

import json
from typing import Any

from .side_files import SIDE_DIR

__all__ = ["HEALTH", "read_health", "write_health"]

HEALTH = "health.json"


def write_health(step_dir: Any, record: Any) -> None:
    """Write ``record``'s health into ``step_dir`` (a :class:`~gemini_dcp.persistent.step_dir.StepDir`);
    nothing for a record that was not checked."""
    healthy = getattr(record, "healthy", None)
    if healthy is None:
        return
    data = {"healthy": bool(healthy), "nonfinite": [list(c) for c in getattr(record, "nonfinite", ())]}
    step_dir.put_bytes(f"{SIDE_DIR}/{HEALTH}", json.dumps(data, sort_keys=True).encode(), atomic=True)


def read_health(step_dir: Any) -> dict[str, Any] | None:
    """The health written into ``step_dir`` (None: none, or unreadable: counts as healthy)."""
    path = step_dir.file(f"{SIDE_DIR}/{HEALTH}")
    try:
        raw = step_dir._call("read of", path, step_dir.fs.cat_file, path)  # bounded by the store deadline
        data = json.loads(raw)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("healthy"), bool) else None
