"""A persisted step's timeline (:mod:`gemini_dcp.core.timelines`), beside the stock DCP layout.

The drain writes ``.gemini/timeline.json`` before the step's ``.metadata`` (the commit):
``{"timeline": <the timeline its record was saved on>, "lineage": <the job's lineage as the
committing node knew it then>}``. A restore from the store (memory intact or wiped) takes the
newest lineage of all the steps' files (and of the job-level ``.gemini-timeline.json``,
:data:`JOB_TIMELINE`) and never returns a step whose timeline it abandoned.
Stock DCP never reads ``.gemini/``, so the step stays stock-readable; a step without the file
(written by an older release, or by plain DCP) counts as saved on the root timeline ``""``.
JSON, never a pickle; untrusted on read (a file that does not decode counts as absent).
"""

from __future__ import annotations

import json
from typing import Any

from ..core.timelines import Lineage
from .side_files import SIDE_DIR

__all__ = ["JOB_TIMELINE", "TIMELINE", "read_timeline", "write_timeline"]

TIMELINE = "timeline.json"
#: ``<url>/<job_id>/.gemini-timeline.json``: the newest lineage, written by a drain before it uploads a
#: step of a new timeline (so the store knows of a rollback before that step is durable).
JOB_TIMELINE = ".gemini-timeline.json"


def write_timeline(step_dir: Any, timeline: str, lineage: Lineage) -> None:
    """Write ``timeline`` and ``lineage`` into ``step_dir`` (a :class:`~gemini_dcp.persistent.step_dir.StepDir`)."""
    data = {"timeline": timeline, "lineage": lineage.to_json()}
    step_dir.put_bytes(f"{SIDE_DIR}/{TIMELINE}", json.dumps(data, sort_keys=True).encode(), atomic=True)


def read_timeline(step_dir: Any) -> tuple[str, Lineage | None]:
    """The timeline a stored step was saved on and the lineage beside it (``("", None)``: no file,
    or one that does not decode)."""
    path = step_dir.file(f"{SIDE_DIR}/{TIMELINE}")
    try:
        raw = step_dir._call("read of", path, step_dir.fs.cat_file, path)  # bounded by the store deadline
        data = json.loads(raw)
    except (OSError, ValueError):
        return "", None
    if not isinstance(data, dict) or not isinstance(data.get("timeline"), str) or len(data["timeline"]) > 64:
        return "", None
    return data["timeline"], Lineage.from_json(data.get("lineage"))
