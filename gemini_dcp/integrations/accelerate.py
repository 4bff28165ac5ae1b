"""Per-step checkpoints of a Hugging Face Accelerate loop into gemini_dcp's tiers, and the resume.

Accelerate leaves the loop to the user, so the integration is one object beside the loop::

    ckpt = GeminiAcceleratorCheckpoint(accelerator, model, optimizer, scheduler, job_id="run1")
    restored = ckpt.resume()                 # all processes; None: nothing to resume
    for step in range((restored or 0) + 1, steps + 1):
        ...                                  # forward, accelerator.backward, optimizer.step, scheduler.step
        ckpt.save(step)                      # every ``every_n_steps`` steps, into node (and peer) memory
    ckpt.close()                             # async_save=True: waits for the last commit

After :meth:`~GeminiAcceleratorCheckpoint.resume`: ``restored_step``, ``restored_from`` (bytes per tier) and
``restore_seconds``, the names the reader and the Lightning and torchtitan integrations use.

What a step holds: the model and optimizer state (``torch.distributed.checkpoint.state_dict.get_state_dict``
of the prepared objects: DDP's replicated tensors once, FSDP2's DTensor shards as shards), the schedulers'
``state_dict()``, the step, and every process's RNG states (torch CPU, CUDA where present, Python's
``random`` and NumPy's global generator), each process under a key of its own. Not held: the data
position (derive the batch from the step, or save a stateful loader's ``state_dict`` in ``extra``), the
``GradScaler`` of fp16 mixed precision, objects given to ``accelerator.register_for_checkpointing``.

Why not ``accelerator.save_state()``: with an FSDP plugin it builds DCP's ``FileSystemWriter`` itself
(``accelerate.utils.fsdp_utils.save_fsdp_model`` / ``save_fsdp_optimizer``) and, without one, writes
safetensors / ``torch.save`` files; its ``register_save_state_pre_hook`` hooks run after those writes.
No argument or hook routes its model and optimizer into another storage writer, so it cannot write
into gemini_dcp's tiers. It keeps working beside this object (for the folder copies it writes).

Collective: ``resume`` and ``save`` must be called by every process, with the same step. Accelerate is
never imported here: the object works from the prepared model and optimizer and ``accelerator``'s
``process_index`` (``import gemini_dcp`` never needs Accelerate).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..dcp.discovery import newest_restorable_step
from ..dcp.reader import GeminiStorageReader
from ..dcp.writer import GeminiStorageWriter
from ..errors import ConfigError
from ..options import GeminiOptions
from .rng import rng_state, set_rng_state


class GeminiAcceleratorCheckpoint:
    """Saves an Accelerate loop's state into gemini_dcp's tiers every ``every_n_steps`` steps; resumes it.

    ``model`` / ``optimizer`` / ``schedulers``: the objects ``accelerator.prepare`` returned.
    ``extra``: further ``Stateful`` objects (``state_dict`` / ``load_state_dict``) saved and restored
    beside them, e.g. a stateful data loader (the same keys on every process: DCP keeps one copy of a
    value saved under the same key by every process). ``job_id``, ``root``, ``persistent``, ``options``:
    as :class:`gemini_dcp.GeminiStorageWriter`'s (set ``job_id``: a relaunch must find its steps).
    ``async_save``: save through ``AsyncCheckpointer`` (see :meth:`save`); call :meth:`close` after the loop.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedulers: Any | Sequence[Any] = (),
        *,
        job_id: str | None = None,
        root: str | None = None,
        persistent: str | None = None,
        options: GeminiOptions | None = None,
        every_n_steps: int = 1,
        extra: dict[str, Any] | None = None,
        async_save: bool = False,
    ) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}; give 1 to save every step")
        self.accelerator = accelerator
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
        self.schedulers: list[Any] = [schedulers] if hasattr(schedulers, "state_dict") else list(schedulers)
        self.extra = dict(extra or {})
        self.every_n_steps = every_n_steps
        self._where = {"root": root, "job_id": job_id, "persistent": persistent, "options": options}
        self._writer: GeminiStorageWriter | None = None
        self.async_save = async_save
        self._snapshots: Any = None
        self._last_saved: int | None = None  # the last blocking save's step
        self.restored_step: int | None = None
        """The step the last :meth:`resume` restored (None: nothing was resumed)."""
        self.restored_from: dict[str, int] = {}
        """Bytes read per tier (``local``, ``peer``, ``parity``, ``persistent``) by the last :meth:`resume`, summed over
        the processes (``GeminiStorageReader.restored_from``); empty when nothing was resumed."""
        self.restore_seconds: float | None = None
        """Wall seconds of the last :meth:`resume` (finding the step, reading it, putting it into the objects)."""

    def _state(self, step: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "schedulers": {str(i): s.state_dict() for i, s in enumerate(self.schedulers)},
            "step": torch.tensor(step, dtype=torch.int64),
            f"rng_{self.accelerator.process_index}": rng_state(),
        }
        state.update({f"extra_{k}": v.state_dict() for k, v in self.extra.items()})
        return state

    def save(self, step: int, *, force: bool = False) -> bool:
        """Checkpoint the state after ``step`` when ``step`` is a multiple of ``every_n_steps`` (or ``force``).

        Blocking ``dcp.save``: returns once every node committed the step. ``async_save``: through
        :class:`gemini_dcp.AsyncCheckpointer`: the copy runs during the next forward/backward and the next
        ``optimizer.step()`` waits for it; ``save(step)`` returns at once unless the previous step is still
        committing, which it waits for first (docs/async.md, "The bound"): the newest committed step at a
        crash is at most one older than the last ``step`` whose ``save`` returned. All processes must call this.
        """
        if not force and step % self.every_n_steps:
            return False
        if not self.async_save:
            dcp.save(self._state(step), storage_writer=self._get_writer(), checkpoint_id=step)
            self._last_saved = step
            return True
        if self._snapshots is None:
            from ..snapshot.checkpointer import AsyncCheckpointer  # noqa: PLC0415
            from ..snapshot.interleave import interleave_for  # noqa: PLC0415

            self._snapshots = AsyncCheckpointer(self._get_writer(), optimizer=self.optimizer, model=self.model,
                                                interleave=interleave_for(self.model))
        self._snapshots.save(self._state(step), step)
        return True

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this process saw committed: the last blocking save's, or with ``async_save`` the newest
        save that finished (None before). Right after ``save(step)`` returned it is ``step - 1`` or newer."""
        if self._snapshots is not None:
            return self._snapshots.last_committed_step  # type: ignore[no-any-return]
        return self._last_saved

    def close(self) -> None:
        """Wait until the last save committed (``async_save``) and stop its thread. All processes call this."""
        if self._snapshots is not None:
            self._snapshots.close()
            self._snapshots = None

    def _get_writer(self) -> GeminiStorageWriter:
        if self._writer is None:  # one writer for the run (it makes the tier root on a fresh node)
            self._writer = GeminiStorageWriter(**self._where)  # type: ignore[arg-type]
        return self._writer

    def resume(self) -> int | None:
        """Restore the newest restorable step into the objects and return it; None when there is none.

        All processes must call this (after ``accelerator.prepare``). None leaves everything as it was.
        :attr:`restored_step`, :attr:`restored_from` and :attr:`restore_seconds` say what it did.
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict  # noqa: PLC0415

        begin = time.perf_counter()
        self.restored_step, self.restored_from, self.restore_seconds = None, {}, None
        self._get_writer()
        reader = GeminiStorageReader(**self._where)  # type: ignore[arg-type]
        step = newest_restorable_step(reader)
        if step is None:
            return None
        state = self._state(step)
        dcp.load(state, storage_reader=reader, checkpoint_id=step)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(state["schedulers"][str(i)])
        for k, v in self.extra.items():
            v.load_state_dict(state[f"extra_{k}"])
        set_rng_state(state[f"rng_{self.accelerator.process_index}"])
        self.restored_step, self.restored_from = int(state["step"]), dict(reader.restored_from)
        self.restore_seconds = time.perf_counter() - begin
        return self.restored_step


__all__ = ["GeminiAcceleratorCheckpoint"]
