"""``dcp.async_save`` with gemini: :class:`AsyncGeminiStorageWriter`, a writer that is also
DCP's ``AsyncStager`` (its staging is the zero-copy structural snapshot; an optimizer guard
stands in for DCP's staging future).
"""

from __future__ import annotations

from typing import Any

from ..commit.hooks import SaveHooks
from ..dcp.writer import GeminiStorageWriter
from ..transport.comm import new_scope
from .handles import SnapshotHandle, checkpoint_group
from .structure import StructureCache, buffer_storages

__all__ = ["AsyncGeminiStorageWriter"]


class AsyncGeminiStorageWriter(GeminiStorageWriter):
    """A GeminiStorageWriter that is also DCP's ``AsyncStager``, for ``dcp.async_save``::

        writer = AsyncGeminiStorageWriter(job_id="run1", model=model)
        writer.install_guard(opt)                     # optimizer.step() waits for the local copy
        fut = None
        for step in ...:
            ...; opt.step()
            if fut is not None:
                fut.result()                          # rule 2
            fut = writer.track(dcp.async_save(sd, storage_writer=writer, checkpoint_id=step,
                                              process_group=writer.checkpoint_group))   # rule 1

    ``stage()`` is the zero-copy structural snapshot (no tensor is copied; the
    guard keeps the optimizer from changing them until this rank's bytes are in
    the tier), so ``async_save`` returns in about a millisecond. Two rules are
    the caller's, because DCP gives the stager no say over them:

    1. pass ``process_group=writer.checkpoint_group``: DCP otherwise runs its
       planning collectives on WORLD from its background thread, concurrently
       with training collectives on the same group (a hang or mixed-up data);
    2. wait for the previous ``async_save`` future before the next call: DCP
       starts a new thread per call, and two saves on one writer and one group
       at the same time would interleave their collectives.

    ``track(future)`` lets the guard give up when the save fails before its copy
    (DCP's planning collectives), instead of waiting for ``timeout_s``; the
    error itself is in the future, as with any ``async_save``.
    :class:`AsyncCheckpointer` follows both rules for you, paces the copy
    (interleaving) and surfaces errors itself.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, *args: Any, model: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clone_storages = buffer_storages(model)
        self._structure = StructureCache(self._clone_storages)
        self._handle: SnapshotHandle | None = None
        self.comm_scope = new_scope("async-writer")  # its background saves never share a group with the training thread's
        self.checkpoint_group = checkpoint_group(self.process_group, self.options.timeout_s, self.comm_scope)
        self.hooks = SaveHooks(on_local_copy_done=self._copied)
        self._guard_hooks: list[Any] = []

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Zero-copy staging: copy the containers, keep the tensors, arm the guard."""
        self._handle = SnapshotHandle(-1)
        return self._structure.snapshot(state_dict).state_dict

    def synchronize_staging(self) -> None:
        """Nothing to do: staging is the structural snapshot; use ``wait_copied()``."""

    def close(self) -> None:
        for h in self._guard_hooks:
            h.remove()
        self._guard_hooks.clear()

    def install_guard(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` wait for the outstanding local copy."""
        self._guard_hooks.append(optimizer.register_step_pre_hook(lambda *_: self.wait_copied()))

    def track(self, future: Any) -> Any:
        """Release the guard if ``future`` (from ``dcp.async_save``) ends before the copy did."""
        h = self._handle
        if h is not None and hasattr(future, "add_done_callback"):
            future.add_done_callback(lambda _f: h.copied.set())
        return future

    def wait_copied(self, timeout: float | None = None) -> None:
        """Block until this rank's bytes of the last staged save are in the tier."""
        h = self._handle
        if h is not None:
            h.wait_copied(self.options.timeout_s if timeout is None else timeout, surface=False)

    def _copied(self, step: int) -> None:
        h = self._handle
        if h is not None:
            h.step = step
            h.copied.set()
