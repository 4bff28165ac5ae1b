"""Where to resume from: gemini_dcp's tiers or a trainer's own checkpoint folder (pure, no torch).

A trainer such as torchtitan keeps interval checkpoints as ``<folder>/step-<N>`` directories (a step
counts once its ``.metadata`` — or, for a Hugging Face export, ``model.safetensors.index.json`` — is
there), while gemini_dcp holds the recent steps in memory (and its persistent tier). On restart the
newest of the two wins; on a tie gemini_dcp's copy is taken (memory is the faster read, and it always
holds the full training state, where a trainer's last-step export may be model-only).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError

STEP_DIR = re.compile(r"step-([0-9]+)")
"""A trainer's step folder name, ``step-<N>`` (group 1: N)."""

MARKERS = (".metadata", "model.safetensors.index.json")
"""The files that make a step folder complete (torchtitan's own test): DCP's metadata or a Hugging Face export's index."""

Source = Literal["gemini", "folder", "fresh"]
"""Where a :class:`ResumeChoice` resumes from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeChoice:
    """The step to resume from and where it lives: ``gemini`` (memory tiers or gemini_dcp's persistent
    tier), ``folder`` (the trainer's own ``<folder>/step-<N>``) or ``fresh`` (nothing to resume)."""

    source: Source
    step: int | None

    def __post_init__(self) -> None:
        if self.source not in ("gemini", "folder", "fresh"):
            raise ConfigError(f"source={self.source!r}: use 'gemini', 'folder' or 'fresh'.")
        if (self.step is None) != (self.source == "fresh"):
            raise ConfigError(f"step={self.step!r} with source={self.source!r}: a fresh start has no step, "
                              "a resume from gemini or the folder has one.")
        if self.step is not None and self.step < 0:
            raise ConfigError(f"step={self.step}: steps are ints >= 0.")


def step_of_dir(name: str) -> int | None:
    """N for a directory named ``step-<N>``, else None."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def newest_folder_step(names: Iterable[str], is_complete: Callable[[str], bool]) -> int | None:
    """The largest N among the ``step-<N>`` names for which ``is_complete(name)`` holds, else None.

    ``is_complete`` is asked only about ``step-<N>`` names, newest first, and the first complete one
    wins: a half-written newest step (a save killed mid-way) is skipped for the one before it.
    """
    steps = sorted(((s, n) for n in names if (s := step_of_dir(n)) is not None), reverse=True)
    for step, name in steps:
        if is_complete(name):
            return step
    return None


def newest_local_folder_step(folder: str | os.PathLike[str]) -> int | None:
    """:func:`newest_folder_step` of a folder on a local file system (None if it does not exist)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    return newest_folder_step(
        names, lambda n: any(os.path.isfile(os.path.join(folder, n, m)) for m in MARKERS)
    )


def choose_resume(gemini_step: int | None, folder_step: int | None) -> ResumeChoice:
    """The newest of gemini_dcp's newest restorable step and the folder's newest complete step (a tie
    goes to gemini_dcp); ``fresh`` when neither has one. ``-1`` (torchtitan's "none") counts as None."""
    g = None if gemini_step is None or gemini_step < 0 else gemini_step
    f = None if folder_step is None or folder_step < 0 else folder_step
    if g is None and f is None:
        return ResumeChoice(source="fresh", step=None)
    if f is None or (g is not None and g >= f):
        return ResumeChoice(source="gemini", step=g)
    return ResumeChoice(source="folder", step=f)


def saves_at(step: int, every: int) -> bool:
    """Whether a job that checkpoints into gemini_dcp every ``every`` steps saves at ``step``."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"every={every!r}: give the number of steps between gemini_dcp saves, an int >= 1 (1: every step).")
    return step > 0 and step % every == 0


__all__ = [
    "MARKERS", "STEP_DIR", "ResumeChoice", "Source", "choose_resume", "newest_folder_step", "newest_local_folder_step",
    "saves_at", "step_of_dir",
]
