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
  (a tie goes to memory); the rest goes back to Lightning, which restores ``global_step``, epoch, loops, callbacks and
  schedulers from it as from any checkpoint. With nothing to resume it returns a checkpoint that holds no
  state (Lightning requires a version and the schedulers' states: their own): training starts at step 0. ``gemini:step-<N>`` loads step N.
- Not restored: the data position of a loader without ``state_dict`` / ``load_state_dict`` (Lightning's
  rule: it warns, and the epoch's data restarts; give a stateful loader, or draw batches from the step).

Lightning is imported only when the class is first used (``import gemini_dcp`` never needs Lightning):
``GeminiModelParallelStrategy`` is built by :func:`strategy_class` on first access.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESUME = "gemini:newest"
"""``trainer.fit(ckpt_path=RESUME)``: resume from the newest restorable step, or start fresh when none."""

_STEP_PATH = re.compile(r"^gemini:step-(\d+)$")


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
                trainer.save_checkpoint(gemini_path(step))

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
            self.gemini_restored: dict[str, Any] = {}
            """After a resume: ``step``, and ``tiers`` (bytes read per tier) or ``folder`` (Lightning's own checkpoint)."""

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            if self.gemini_every and not any(isinstance(c, SaveEveryNSteps) for c in trainer.callbacks):
                trainer.callbacks.append(SaveEveryNSteps(self.gemini_every))

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
            """Lightning's own newest sharded checkpoint in a ``ModelCheckpoint``'s ``dirpath``: (global_step,
            path), as rank 0 sees it (collective: broadcast). Its ``meta.pt`` is read with ``weights_only=True``;
            one that does not load so is passed over (logged)."""
            found: tuple[int, str] | None = None
            if self.global_rank == 0:
                for cb in self.lightning_module.trainer.checkpoint_callbacks:
                    d = Path(getattr(cb, "dirpath", None) or "/nonexistent")
                    for p in sorted(d.iterdir()) if d.is_dir() else []:
                        if not (p / "meta.pt").is_file():
                            continue
                        try:
                            got = int(torch.load(p / "meta.pt", weights_only=True)["global_step"])
                        except Exception as exc:  # noqa: BLE001 - another writer's file: not ours to judge
                            log.warning("gemini_dcp: passing over %s (%s)", p, exc)
                            continue
                        if found is None or got > found[0]:
                            found = (got, str(p))
            return self.broadcast(found)  # type: ignore[no-any-return]

        def _torch_optimizers(self) -> list[Any]:
            return [getattr(o, "_optimizer", o) for o in self.optimizers]

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            step = parse_gemini_path(filepath)
            if step is False:
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            if step is None:
                raise ConfigError(f"save to {RESUME!r}: give gemini_path(step) to name the step saved")
            state = {"state_dict": checkpoint.pop("state_dict"),
                     **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
            buf = io.BytesIO()
            torch.save(checkpoint, buf)  # the rest: one value, read back with torch.load as Lightning's own
            state["lightning"] = buf.getvalue()
            state[f"rng_{self.global_rank}"] = rng_state()
            dcp.save(state, storage_writer=self._writer(), checkpoint_id=step)
            return None

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            want = parse_gemini_path(checkpoint_path)
            if want is False:
                return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[no-any-return]
            self._writer()
            reader = GeminiStorageReader(**self.gemini_where)
            folder = self._newest_folder_checkpoint() if want is None else None
            step = newest_restorable_step(reader, want, has_fallback=folder is not None)
            if folder is not None and (step is None or folder[0] > step):  # a tie goes to memory
                log.info("gemini_dcp: resuming from Lightning's %s (step %d; gemini_dcp's newest: %s)",
                         folder[1], folder[0], step)
                self.gemini_restored = {"step": folder[0], "folder": folder[1]}
                return super().load_checkpoint(folder[1], weights_only)  # type: ignore[no-any-return]
            if step is None:
                if want is not None:
                    raise ConfigError(f"gemini_dcp holds no restorable step {want} of job {reader.job_id!r}")
                return self._nothing_to_resume()
            optimizers = self._torch_optimizers()
            state: dict[str, Any] = {
                "state_dict": get_model_state_dict(self.model),
                **{f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(optimizers)},
                "lightning": b"",
                f"rng_{self.global_rank}": rng_state(),
            }
            dcp.load(state, storage_reader=reader, checkpoint_id=step)
            strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
            set_model_state_dict(self.model, state["state_dict"], options=_options(strict))
            for i, o in enumerate(optimizers):
                set_optimizer_state_dict(self.model, o, optim_state_dict=state[f"optimizer_{i}"])
            set_rng_state(state[f"rng_{self.global_rank}"])
            self.gemini_restored = {"step": step, "tiers": dict(reader.restored_from)}
            # Lightning's own metadata (loops, callbacks, hparams), restricted to tensors and plain values
            # unless the caller passed weights_only=False to Lightning, as for its own checkpoint files.
            meta = torch.load(io.BytesIO(state["lightning"]), weights_only=weights_only is not False)
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


__all__ = ["RESUME", "GeminiModelParallelStrategy", "gemini_path", "parse_gemini_path", "strategy_class"]  # noqa: F822 - lazy
