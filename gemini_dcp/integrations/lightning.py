"""Per-step checkpoints of a Lightning ``Trainer`` into gemini_dcp's tiers, and the resume.

Lightning's ``CheckpointIO`` plugins are bypassed for sharded (DCP) checkpoints; those go through
``ModelParallelStrategy.save_checkpoint`` / ``load_checkpoint``. :class:`GeminiModelParallelStrategy` is
that strategy (FSDP2 / tensor parallel, ``fully_shard`` in ``configure_model``; it runs on CPU over gloo)
with both methods taught one more kind of path::

    strategy = GeminiModelParallelStrategy(job_id="run1", every_n_steps=1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1000,
                        callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=500)])
    trainer.fit(model, ckpt_path=RESUME)     # the newest restorable step, or a fresh start when none

- **Saving**: every ``every_n_steps`` optimizer steps (at ``on_train_batch_end``, where Lightning's own
  ``ModelCheckpoint(every_n_train_steps=...)`` saves) the strategy calls ``trainer.save_checkpoint`` with
  the path ``gemini:step-<global_step>``: Lightning builds its full checkpoint dict (model and optimizer
  state sharded as DCP saves them, ``global_step``, epoch, the loops' progress, callbacks' and LR schedulers'
  states, hyper-parameters), and ``save_checkpoint`` saves it with ``dcp.save(...,
  storage_writer=GeminiStorageWriter(...))`` into node (and peer) memory, plus every process's RNG states.
  Any other path is Lightning's own sharded checkpoint folder: ``ModelCheckpoint`` keeps working beside it.
- **Resuming**: ``ckpt_path=RESUME`` (``"gemini:newest"``) makes ``load_checkpoint`` ask
  :func:`gemini_dcp.newest_restorable_step` (collective) and load that step into the live model and
  optimizer — or Lightning's own newest sharded checkpoint in a ``ModelCheckpoint`` folder when that is newer
  (a tie goes to memory) and was written by the same ``job_id`` (its ``meta.pt`` holds it: a folder checkpoint
  of another job, or of none, is passed over with a warning, never resumed by ``RESUME``; give its path as
  ``ckpt_path`` to resume it on purpose); the rest goes back to Lightning, which restores ``global_step``, epoch,
  loops, callbacks and schedulers from it as from any checkpoint. With nothing to resume it returns a checkpoint
  that holds no state (Lightning requires a version and the schedulers' states: their own): training starts at
  step 0. ``gemini:step-<N>`` loads step N. ``restored_step``, ``restored_from`` (bytes per tier),
  ``restore_seconds`` and ``restored_folder`` say what the last restore did.
- **The RNG streams the next step sees are the uninterrupted run's.** Each rank's RNG states (torch, CUDA,
  Python, NumPy) are saved with the step but not put back in ``load_checkpoint``: Lightning then calls
  ``train_dataloader()`` and builds the loader's iterator, whose base seed is one draw from the global
  generator (``torch.utils.data``), and the uninterrupted run made that draw at its epoch's start, not after
  the step saved. The states go back in the strategy's ``on_train_start``, the last hook before the first
  batch is fetched. Within an epoch the iterator built before continues; for a step that ended its epoch,
  the uninterrupted run built the next epoch's iterators after the save, so they are built again there,
  from the restored states. The samplers get the resumed epoch (``set_epoch``) before Lightning builds an
  iterator (``process_dataloader``). A plain ``DataLoader`` with or without a generator, with workers, a
  ``DistributedSampler`` and a ``CombinedLoader`` all resume into the uninterrupted run's dropout masks.
- **The data position** of a stateful loader (``state_dict`` / ``load_state_dict``: torchdata's
  ``StatefulDataLoader``) is saved with the step, each rank's own (Lightning keeps it in the loops' state;
  each rank's checkpoint dict is saved under a key of its own), and restored. A loader without them
  cannot be put back within an epoch: at such a restore the strategy logs one WARNING naming it (its data
  restart at the epoch's first batch while the step counter continues).

Lightning is imported only when the class is first used (``import gemini_dcp`` never needs Lightning):
``GeminiModelParallelStrategy`` is built by :func:`strategy_class` on first access.
"""

from __future__ import annotations

import io
import logging
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESUME = "gemini:newest"
"""``trainer.fit(ckpt_path=RESUME)``: resume from the newest restorable step, or start fresh when none."""

_STEP_PATH = re.compile(r"^gemini:step-(\d+)$")

JOB_KEY = "gemini_job_id"
"""The key under which a folder checkpoint's ``meta.pt`` names the job that wrote it (``RESUME`` takes only its own)."""


def gemini_path(step: int) -> str:
    """The checkpoint path that names ``step`` in gemini_dcp's tiers (``trainer.save_checkpoint(gemini_path(n))``)."""
    return f"gemini:step-{int(step)}"


def parse_gemini_path(path: Any) -> int | None | bool:
    """``step`` for ``gemini:step-<step>``, None for :data:`RESUME`, False for any other path (Lightning's own)."""
    text = str(path)
    if text == RESUME:
        return None
    m = _STEP_PATH.match(text)
    return int(m.group(1)) if m else False


_CLASS: Any = None


def strategy_class() -> Any:
    """:class:`GeminiModelParallelStrategy`, built on first use (imports Lightning and torch)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import lightning  # noqa: PLC0415 - optional dependency
    import torch  # noqa: PLC0415 - torch and Lightning only once a Lightning job asks for the class
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from lightning.fabric.utilities.data import _set_sampler_epoch  # noqa: PLC0415
    from lightning.fabric.utilities.types import _Stateful  # noqa: PLC0415
    from lightning.pytorch.callbacks import Callback  # noqa: PLC0415
    from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ..dcp.discovery import newest_restorable_step  # noqa: PLC0415
    from ..dcp.reader import GeminiStorageReader  # noqa: PLC0415
    from ..dcp.writer import GeminiStorageWriter  # noqa: PLC0415
    from ..errors import ConfigError  # noqa: PLC0415
    from .rng import rng_state, set_rng_state  # noqa: PLC0415

    class SaveEveryNSteps(Callback):  # type: ignore[misc]
        """Calls ``trainer.save_checkpoint(gemini_path(global_step))`` every ``every`` optimizer steps."""

        def __init__(self, every: int) -> None:
            self.every, self.last = every, -1

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step
            if step != self.last and step % self.every == 0:  # accumulating batches do not step
                self.last = step
                trainer.save_checkpoint(gemini_path(step), weights_only=False)  # the whole checkpoint, said aloud

    class GeminiModelParallelStrategy(ModelParallelStrategy):  # type: ignore[misc]
        """``ModelParallelStrategy`` that also checkpoints into gemini_dcp's tiers (module docstring).

        ``job_id``, ``root``, ``persistent``, ``options``: as :class:`gemini_dcp.GeminiStorageWriter`'s (set
        ``job_id``: a relaunch must find its steps); ``every_n_steps``: save every this many optimizer steps
        (0: only when ``trainer.save_checkpoint(gemini_path(n))`` is called). Other keywords go to
        ``ModelParallelStrategy``. Saves and loads are collective, as every Lightning sharded checkpoint.
        """

        def __init__(self, *, job_id: str | None = None, root: str | None = None, persistent: str | None = None,
                     options: Any = None, every_n_steps: int = 1, **kwargs: Any) -> None:
            if every_n_steps < 0:
                raise ConfigError(f"every_n_steps must be >= 0, got {every_n_steps}; give 1 to save every step")
            super().__init__(**kwargs)
            self.gemini_where = {"root": root, "job_id": job_id, "persistent": persistent, "options": options}
            self.gemini_every = every_n_steps
            self.gemini_writer: GeminiStorageWriter | None = None
            self.restored_step: int | None = None
            """The step the last restore put back (from gemini_dcp or Lightning's folder); None: nothing resumed."""
            self.restored_from: dict[str, int] = {}
            """Bytes read per gemini_dcp tier by the last restore, summed over the ranks (empty: from a folder)."""
            self.restore_seconds: float | None = None
            """Wall seconds of the last restore (finding the step, reading it, into the live model and optimizer)."""
            self.restored_folder: str | None = None
            """Lightning's sharded checkpoint folder the last restore read, when it came from one."""
            self._rng_pending: dict[str, Any] | None = None  # the restored step's RNG states, not put back yet

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            if self.gemini_every and not any(isinstance(c, SaveEveryNSteps) for c in trainer.callbacks):
                trainer.callbacks.append(SaveEveryNSteps(self.gemini_every))

        def process_dataloader(self, dataloader: Any) -> Any:
            """After a restore: the samplers' ``set_epoch`` of the epoch the resumed run trains in, before Lightning
            builds the iterator (it calls ``set_epoch`` only after, and a ``DataLoader`` with workers draws its
            sampler's first indices when its iterator is built)."""
            dataloader = super().process_dataloader(dataloader)
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if self._rng_pending is None or trainer is None or not trainer.training:
                return dataloader
            fit = trainer.fit_loop
            ended = bool(fit.epoch_loop.batch_progress.is_last_batch)  # the step restored ended its epoch
            _set_sampler_epoch(dataloader, fit.epoch_progress.current.processed + int(ended))
            return dataloader

        def on_train_start(self) -> None:
            """After a restore, the last hook before the first batch is fetched: the RNG states saved with the step
            go back. Within an epoch, the iterator Lightning built since (whose base seed was a draw from the global
            generator) continues. For a step that ended its epoch, the uninterrupted run built the next epoch's
            iterators after the save, from these states: they are built again now, from them (a stateful loader
            loaded at its epoch's end also built a second one). One warning names every loader whose position
            within an epoch could not be restored."""
            super().on_train_start()
            state, self._rng_pending = self._rng_pending, None
            if state is None:
                return
            fit = self.lightning_module.trainer.fit_loop
            set_rng_state(state)
            if fit.epoch_loop.batch_progress.is_last_batch:
                if fit._data_fetcher is not None and fit._combined_loader is not None:
                    iter(fit._data_fetcher)  # what the epoch loop does at an epoch's start
            else:
                self._warn_unrestorable_loaders()

        def _warn_unrestorable_loaders(self) -> None:
            loader = self.lightning_module.trainer.fit_loop._combined_loader
            loaders = list(loader.flattened) if loader is not None else []
            lost = [f"#{i} ({type(dl).__name__})" for i, dl in enumerate(loaders) if not isinstance(dl, _Stateful)]
            if lost and self.global_rank == 0:
                log.warning(
                    "gemini_dcp: resumed step %s within an epoch, but the data position of train_dataloader's loader %s "
                    "of %d cannot be restored (no state_dict / load_state_dict): its batches restart at the epoch's first "
                    "one while the step counter continues, so training does not see the batches an uninterrupted run "
                    "would. Use a stateful loader (torchdata's StatefulDataLoader), or draw each batch from the step.",
                    self.restored_step, ", ".join(lost), len(loaders))

        def _writer(self) -> GeminiStorageWriter:
            if self.gemini_writer is None:  # one writer for the run (it makes the tier root on a fresh node)
                self.gemini_writer = GeminiStorageWriter(**self.gemini_where)
            return self.gemini_writer

        def _nothing_to_resume(self) -> dict[str, Any]:
            """The checkpoint Lightning restores as "no checkpoint": every state stays as it is.

            Lightning reads the version and requires ``lr_schedulers`` in any checkpoint it resumes; the
            schedulers get their own current state back, nothing else is in the dict.
            """
            trainer = self.lightning_module.trainer
            return {"pytorch-lightning_version": lightning.__version__,
                    "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}

        def _newest_folder_checkpoint(self) -> tuple[int, str] | None:
            """Lightning's own newest sharded checkpoint of this job in a ``ModelCheckpoint``'s ``dirpath``:
            (global_step, path), as rank 0 sees it (collective: broadcast). Its ``meta.pt`` is read with
            ``weights_only=True``; one that does not load so, or that another job wrote (its ``gemini_job_id``
            is not this strategy's, or it has none), is passed over with a warning."""
            found: tuple[int, str] | None = None
            if self.global_rank == 0:
                job = self._writer().job_id
                for cb in self.lightning_module.trainer.checkpoint_callbacks:
                    d = Path(getattr(cb, "dirpath", None) or "/nonexistent")
                    for p in sorted(d.iterdir()) if d.is_dir() else []:
                        if not (p / "meta.pt").is_file():
                            continue
                        try:
                            meta = torch.load(p / "meta.pt", weights_only=True)
                            got, owner = int(meta["global_step"]), meta.get(JOB_KEY)
                        except Exception as exc:  # noqa: BLE001 - another writer's file: not ours to judge
                            log.warning("gemini_dcp: passing over %s (%s)", p, exc)
                            continue
                        if owner != job:
                            log.warning(
                                "gemini_dcp: not resuming %s (step %d): it was written by %s, and this run is job %r. "
                                "ckpt_path=RESUME resumes only this job's checkpoints; give its path as ckpt_path to "
                                "resume it on purpose, or another ModelCheckpoint dirpath to keep runs apart.",
                                p, got, f"job {owner!r}" if owner is not None else "a run without a gemini_dcp job id", job)
                            continue
                        if found is None or got > found[0]:
                            found = (got, str(p))
            return self.broadcast(found)  # type: ignore[no-any-return]

        def _torch_optimizers(self) -> list[Any]:
            return [getattr(o, "_optimizer", o) for o in self.optimizers]

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            step = parse_gemini_path(filepath)
            if step is False:  # Lightning's own folder: its meta.pt names the job (RESUME takes only the job's own)
                checkpoint[JOB_KEY] = self._writer().job_id
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            if step is None:
                raise ConfigError(f"save to {RESUME!r}: give gemini_path(step) to name the step saved")
            state = {"state_dict": checkpoint.pop("state_dict"),
                     **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
            buf = io.BytesIO()
            torch.save(checkpoint, buf)  # the rest: one value, read back with torch.load as Lightning's own
            state[f"lightning_{self.global_rank}"] = buf.getvalue()  # each rank's own: its loaders' positions
            state[f"rng_{self.global_rank}"] = rng_state()
            dcp.save(state, storage_writer=self._writer(), checkpoint_id=step)
            return None

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            want = parse_gemini_path(checkpoint_path)
            if want is False:
                return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[no-any-return]
            begin = time.perf_counter()
            self.restored_step, self.restored_from, self.restore_seconds, self.restored_folder = None, {}, None, None
            self._rng_pending = None
            self._writer()
            reader = GeminiStorageReader(**self.gemini_where)
            folder = self._newest_folder_checkpoint() if want is None else None
            step = newest_restorable_step(reader, want, has_fallback=folder is not None)
            if folder is not None and (step is None or folder[0] > step):  # a tie goes to memory
                log.info("gemini_dcp: resuming from Lightning's %s (step %d; gemini_dcp's newest: %s)",
                         folder[1], folder[0], step)
                meta = super().load_checkpoint(folder[1], weights_only)
                self.restored_step, self.restored_folder = folder[0], folder[1]
                self.restore_seconds = time.perf_counter() - begin
                return meta  # type: ignore[no-any-return]
            if step is None:
                if want is not None:
                    raise ConfigError(f"gemini_dcp holds no restorable step {want} of job {reader.job_id!r}")
                return self._nothing_to_resume()
            optimizers = self._torch_optimizers()
            rank = self.global_rank
            state: dict[str, Any] = {
                "state_dict": get_model_state_dict(self.model),
                **{f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(optimizers)},
                f"lightning_{rank}": b"",
                f"rng_{rank}": rng_state(),
            }
            dcp.load(state, storage_reader=reader, checkpoint_id=step)
            strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
            set_model_state_dict(self.model, state["state_dict"], options=_options(strict))
            for i, o in enumerate(optimizers):
                set_optimizer_state_dict(self.model, o, optim_state_dict=state[f"optimizer_{i}"])
            # Put back where the resumed run reaches the point of the save (process_dataloader / on_train_start).
            self._rng_pending = state[f"rng_{rank}"]
            # Lightning's own metadata (loops, callbacks, hparams), restricted to tensors and plain values
            # unless the caller passed weights_only=False to Lightning, as for its own checkpoint files.
            meta = torch.load(io.BytesIO(state[f"lightning_{rank}"]), weights_only=weights_only is not False)
            self.restored_step, self.restored_from = step, dict(reader.restored_from)
            self.restore_seconds = time.perf_counter() - begin
            return meta  # type: ignore[no-any-return]

    def _options(strict: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions  # noqa: PLC0415

        return StateDictOptions(strict=strict)

    _CLASS = GeminiModelParallelStrategy
    return _CLASS


def __getattr__(name: str) -> Any:
    """``GeminiModelParallelStrategy`` is built (Lightning imported) on first access."""
    if name == "GeminiModelParallelStrategy":
        return strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["JOB_KEY", "RESUME", "GeminiModelParallelStrategy", "gemini_path", "parse_gemini_path", "strategy_class"]  # noqa: F822 - lazy
