"""torchtitan: checkpoint every step into gemini_dcp's tiers, resume from the newest step anywhere.

torchtitan (0.3.0) builds its ``CheckpointManager`` from ``config.checkpoint`` and offers no setting
for a third-party storage writer, so gemini_dcp comes in as a subclass, :class:`GeminiCheckpointManager`
(built on first use: torchtitan is imported lazily, and only here):

- every ``gemini_every`` steps (default: every step) the full training state torchtitan saves
  (model, optimizer, lr schedulers, dataloader, train state) goes into gemini_dcp's tiers through
  ``AsyncCheckpointer`` (default ``gemini_async=True``: the save returns at once, the copy overlaps the
  next step's forward and backward, only the next ``optimizer.step()`` waits for it; plan replay, no
  DCP planning per step; docs/async.md), or, with ``gemini_async=False``, a blocking
  ``dcp.save(..., storage_writer=GeminiStorageWriter, checkpoint_id=step)``. The state dict is
  torchtitan's own ``_flattened_model_states_sd()``, with the model's part from
  :class:`ModelStatesCache` (no full ``model.state_dict()`` per step: the same dict and values);
- torchtitan's own interval checkpoints (``--checkpoint.interval``, ``<dump>/<folder>/step-<N>``,
  sync or ``async``, its purge, its last-step export) keep working beside it (``gemini_folder_saves=False``
  turns them off: gemini_dcp's persistent tier, ``gemini_persistent=<fsspec url>`` every
  ``gemini_persist_every`` steps, then takes their place, in stock DCP layout);
- on (re)start, ``load`` resumes from the newest of gemini_dcp's newest restorable step (local, peer,
  and persistent memory tiers) and torchtitan's newest complete ``step-<N>`` folder (a tie goes to
  gemini_dcp); ``--checkpoint.load_step N`` loads step N from gemini_dcp if it holds it, else from the folder.
  A resume from gemini_dcp goes through :func:`gemini_dcp.fast_load` (straight from the node's slots
  into the live model and optimizer state when the structure is the one saved; ``dcp.load`` with
  the same reader otherwise: a reshard, a wiped node, the persistent tier). What it restored: the manager's
  ``restored_step``, ``restored_from`` (bytes per tier), ``restore_seconds`` and ``restored_folder`` — the
  names the reader and the Lightning and Accelerate integrations use (docs/integrations.md).

Select it without touching torchtitan's code, on the command line of any config::

    --checkpoint.enable --override.imports gemini_dcp.integrations.torchtitan.gemini_checkpoint
    # with settings: 'gemini_dcp.integrations.torchtitan.gemini_checkpoint={"gemini_replicas": 2}'

or in a config function: ``checkpoint=gemini_checkpoint_config(interval=500, gemini_replicas=2)``.
The tier root and job id default as the writer's do (``$GEMINI_DCP_ROOT``, ``$TORCHELASTIC_RUN_ID``).
Works with torch 2.13 + torchtitan 0.3.0 (README); the CPU launcher is ``examples/torchtitan/``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.config import resolve_root
from ..errors import ConfigError
from ..local.job_dir import check_root, create_root
from ..options import GeminiOptions
from .model_states import ModelStatesCache
from .resume import choose_resume, saves_at

log = logging.getLogger(__name__)

OVERRIDE = "gemini_dcp.integrations.torchtitan.gemini_checkpoint"
"""The ``--override.imports`` target (torchtitan 0.3.0) that registers the Gemini checkpoint manager."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TitanGeminiSettings:
    """The gemini_dcp side of a torchtitan job: how often to save into the tiers, whether torchtitan's own
    folder checkpoints stay on, and the tier options (writer keywords: ``root``, ``job_id``, ``replicas``,
    ``keep``, ``persistent``, ``persist_every``; the environment's ``GEMINI_DCP_*`` under them)."""

    every: int = 1
    folder_saves: bool = True
    async_save: bool = True
    writer_keywords: dict[str, Any] = field(default_factory=dict)
    options: GeminiOptions = field(init=False)

    def __post_init__(self) -> None:
        saves_at(1, self.every)  # validates every
        if not isinstance(self.folder_saves, bool):
            raise ConfigError(f"gemini_folder_saves={self.folder_saves!r}: give True (keep torchtitan's folder "
                              "checkpoints) or False (gemini_dcp's tiers only).")
        if not isinstance(self.async_save, bool):
            raise ConfigError(f"gemini_async={self.async_save!r}: give True (AsyncCheckpointer: the copy overlaps "
                              "the next step) or False (a blocking dcp.save per step).")
        try:
            options = GeminiOptions.from_env(**{k: v for k, v in self.writer_keywords.items() if v is not None})
        except TypeError as exc:
            raise ConfigError(f"gemini_dcp writer settings {self.writer_keywords!r}: {exc}") from None
        object.__setattr__(self, "options", options)

    @classmethod
    def from_config(cls, config: Any) -> TitanGeminiSettings:
        """The settings held in a :class:`GeminiCheckpointManager` config (its ``gemini_*`` fields)."""
        return cls(
            every=config.gemini_every, folder_saves=config.gemini_folder_saves, async_save=config.gemini_async,
            writer_keywords={k: getattr(config, f"gemini_{k}") for k in WRITER_FIELDS},
        )


WRITER_FIELDS = ("root", "job_id", "replicas", "keep", "persistent", "persist_every")
"""The ``GeminiStorageWriter`` keywords a torchtitan config sets, each as its ``gemini_<name>`` field."""


def torchtitan_available() -> bool:
    """Whether torchtitan can be imported here (without importing it)."""
    return importlib.util.find_spec("torchtitan") is not None


@functools.cache
def checkpoint_manager_class() -> Any:
    """:class:`GeminiCheckpointManager`, built on first use (imports torchtitan and torch)."""
    import torch  # noqa: PLC0415 - torch and torchtitan only once a torchtitan job asks for the class
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torchtitan.components.checkpointer import CheckpointManager  # noqa: PLC0415 - optional dependency
    from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER, ModelWrapper  # noqa: PLC0415
    from torchtitan.tools import filesystem  # noqa: PLC0415

    from ..dcp.discovery import newest_restorable_step  # noqa: PLC0415
    from ..dcp.fast_load import fast_load  # noqa: PLC0415 - torch
    from ..dcp.optim_state import init_optimizer_state  # noqa: PLC0415 - torch
    from ..dcp.reader import GeminiStorageReader  # noqa: PLC0415 - torch
    from ..dcp.writer import GeminiStorageWriter  # noqa: PLC0415
    from ..snapshot.checkpointer import AsyncCheckpointer  # noqa: PLC0415
    from ..snapshot.interleave import interleave_for  # noqa: PLC0415

    class GeminiCheckpointManager(CheckpointManager):  # type: ignore[misc, valid-type]
        """torchtitan's ``CheckpointManager`` that also checkpoints into gemini_dcp's tiers (module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):  # type: ignore[name-defined, misc]
            gemini_every: int = 1
            """Save into gemini_dcp's tiers every this many steps (1: every step)."""
            gemini_folder_saves: bool = True
            """Keep torchtitan's own interval checkpoints to its folder (False: gemini_dcp's tiers only)."""
            gemini_async: bool = True
            """Save through AsyncCheckpointer: the copy overlaps the next step (False: a blocking dcp.save)."""
            gemini_root: str | None = None
            """Tier root (node tmpfs); default $GEMINI_DCP_ROOT, else /dev/shm/gemini_dcp. Created private (0700)
            where missing; one of another user's, a link or group/other-writable is refused (docs/security.md)."""
            gemini_job_id: str | None = None
            """Job id; default $TORCHELASTIC_RUN_ID (torchrun --rdzv-id)."""
            gemini_replicas: int = 1
            """Copies in memory: 1 (this node) or more (peer nodes too)."""
            gemini_keep: int = 2
            """Committed steps kept in memory."""
            gemini_persistent: str | None = None
            """fsspec URL of gemini_dcp's persistent tier (stock DCP layout), or None."""
            gemini_persist_every: int = 10
            """Drain every this many saved steps to the persistent tier."""

            def __post_init__(self) -> None:
                CheckpointManager.Config.__post_init__(self)
                TitanGeminiSettings.from_config(self)  # ConfigError now, not at the first save

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            if not self.enable:
                return
            self.gemini = TitanGeminiSettings.from_config(config)
            _prepare_root(config.gemini_root)
            self.gemini_writer: GeminiStorageWriter | None = None
            self.gemini_async: AsyncCheckpointer | None = None
            self.gemini_last_load: dict[str, Any] = {}
            """How the last resume from gemini_dcp went: ``path`` (fast_load's), ``reason``, ``read_seconds``,
            ``optimizer_init``."""
            self.restored_step: int | None = None
            """The step the last ``load`` restored, from gemini_dcp or torchtitan's folder (None: a fresh start)."""
            self.restored_from: dict[str, int] = {}
            """Bytes read per gemini_dcp tier by the last ``load``, summed over the ranks (empty: from the folder)."""
            self.restore_seconds: float | None = None
            """Wall seconds of the last ``load`` that restored a step (finding it, reading it, into the live state)."""
            self.restored_folder: str | None = None
            """torchtitan's ``step-<N>`` folder the last ``load`` restored, when it came from there."""
            self.gemini_model_states = ModelStatesCache(ModelWrapper, self.gemini.options.timeout_s)
            self.gemini_save_log: list[dict[str, Any]] = []  # per save: step, state-dict and save() times

        def _gemini_states(self) -> dict[str, Any]:
            """``_flattened_model_states_sd()`` (what torchtitan saves), with the model's part from
            :class:`ModelStatesCache`: the same dict, the same tensors, without ``model.state_dict()`` per step."""
            sd = {k: v for k, v in self.states.items() if k != MODEL}
            if MODEL in self.states:
                sd.update(self.gemini_model_states.get(self.states[MODEL]))
            return sd

        def _writer(self) -> GeminiStorageWriter:
            if self.gemini_writer is None:
                self.gemini_writer = GeminiStorageWriter(options=self.gemini.options)
            return self.gemini_writer

        def _async(self) -> AsyncCheckpointer:
            if self.gemini_async is None:  # collective (its control group): the first save runs on every rank
                model = self.states[MODEL].model
                self.gemini_async = AsyncCheckpointer(
                    self._writer(), optimizer=self.states[OPTIMIZER], model=model, interleave=interleave_for(model)
                )
            return self.gemini_async

        def _log_async(self, step: int, states_s: float, states_cpu_s: float, save_s: float, handle: Any) -> None:
            """One line per save: this step's cost to the training thread, the last finished save's background."""
            done = next((h for h in reversed(self._async().history) if h is not handle and h.finished.is_set()), None)
            back = ""
            if done is not None and done.total_s is not None:
                back = (f"; step {done.step}: copied in {1e3 * (done.copy_s or 0):.0f} ms, committed in "
                        f"{1e3 * done.total_s:.0f} ms, background CPU {1e3 * (done.cpu_s or 0):.0f} ms, "
                        f"training waited {1e3 * done.guard_wait_s:.1f} ms")
            cache = self.gemini_model_states
            log.info("gemini_dcp: step %d snapshot: state dict %.1f ms (CPU %.1f ms; model states: %d reused, %d built), "
                     "save() %.1f ms%s", step, states_s * 1e3, states_cpu_s * 1e3, cache.hits, cache.rebuilds, save_s * 1e3, back)

        def _close(self) -> None:
            ckpt, self.gemini_async = self.gemini_async, None
            try:
                if ckpt is not None:
                    ckpt.close()  # waits for the last step's commit; raises a failed background save
            finally:
                super()._close()

        @torch.no_grad()
        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            saved = False
            if not self.load_only and saves_at(curr_step, self.gemini.every):
                begin, cpu = time.perf_counter(), time.thread_time()
                states = self._gemini_states()
                built, states_cpu = time.perf_counter(), time.thread_time() - cpu
                if self.gemini.async_save:
                    handle = self._async().save(states, curr_step)
                    self._log_async(curr_step, built - begin, states_cpu, time.perf_counter() - built, handle)
                else:
                    dcp.save(states, storage_writer=self._writer(), checkpoint_id=curr_step, planner=_save_planner())
                    cache = self.gemini_model_states
                    log.info("gemini_dcp: step %d saved to the memory tiers in %.3f s (state dict %.1f ms; model states: "
                             "%d reused, %d built)", curr_step, time.perf_counter() - begin, (built - begin) * 1e3,
                             cache.hits, cache.rebuilds)
                saved = True
            if self.gemini.folder_saves:
                saved = super()._save(curr_step, last_step) or saved
            return saved

        @torch.no_grad()
        def _load(self, step: int = -1) -> bool:
            begin = time.perf_counter()
            self.restored_step, self.restored_from, self.restore_seconds, self.restored_folder = None, {}, None, None
            folder_step = self._find_load_step() if step == -1 and filesystem.exists(self.folder) else -1
            reader = GeminiStorageReader(options=self.gemini.options)
            has_folder = folder_step >= 0 or (step != -1 and filesystem.exists(self.folder))
            found = newest_restorable_step(reader, None if step == -1 else step, has_fallback=has_folder)
            choice = choose_resume(found, folder_step)
            if choice.source != "gemini":
                if choice.source == "folder" and dist.get_rank() == 0:
                    log.info("gemini_dcp: newest restorable step %s; torchtitan's folder holds step %d: loading it there",
                             "none" if found is None else found, choice.step)
                loaded = bool(super()._load(step))
                if loaded and choice.source == "folder":
                    self.restored_step, self.restored_folder = choice.step, f"{self.folder}/step-{choice.step}"
                    self.restore_seconds = time.perf_counter() - begin
                return loaded
            # A fresh optimizer gets the state its first step would create, so torchtitan's state_dict()
            # needs no step over zero gradients (gemini_dcp.init_optimizer_state; refused, with nothing
            # changed, for anything but plain Adam/AdamW without step hooks).
            refused = [why for o in getattr(self.states.get(OPTIMIZER), "optimizers", ()) if (why := init_optimizer_state(o))]
            states = self._states_to_load(model_only=False)
            if MODEL in self.states and MODEL not in self.exclude_from_loading:
                # The model's values as gemini_dcp saves them (a fused-qkv split: Shard(0) rows, not torchtitan's
                # replicated ones), so fast_load finds the structure it saved.
                model = self.gemini_model_states.get(self.states[MODEL])
                states.update((k, v) for k, v in model.items() if k in states)
            # Straight into the live model and optimizer state when the structure is the one saved
            # (gemini_dcp.fast_load); anything else goes through dcp.load with the same reader.
            got = fast_load(states, storage_reader=reader, step=choice.step)
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(states)  # torchtitan flattens the model states (as its dcp_load)
            self.gemini_last_load = {"path": got.path, "reason": got.reason, "read_seconds": got.seconds,
                                     "optimizer_init": refused or "created"}
            self.restored_step, self.restored_from = reader.restored_step, dict(reader.restored_from)
            self.restore_seconds = time.perf_counter() - begin
            if dist.get_rank() == 0:
                tiers = ", ".join(f"{k}: {v} B" for k, v in reader.restored_from.items() if v) or "-"
                log.info(
                    "gemini_dcp: resumed from step %s (%s; torchtitan's folder newest: %s) in %.2f s (%s path, tiers read "
                    "in %.2f s; optimizer state %s)", reader.restored_step, tiers, folder_step if folder_step >= 0 else "none",
                    self.restore_seconds, got.path, got.seconds,
                    "created without a step" if not refused else f"by torch's step ({'; '.join(refused)})",
                )
            return True

    GeminiCheckpointManager.__module__ = __name__
    return GeminiCheckpointManager


def _prepare_root(root: str | None) -> None:
    """The job's explicit ``gemini_root``: created private where missing (as torchtitan creates its dump folder),
    then checked as every tier root is (TierRootError now, not at the first save or load). Every rank calls it
    (one root per node). Nothing to do for the environment's or the default root (the tier's own rules)."""
    if not root:
        return
    path = resolve_root(root)
    if create_root(path):
        log.info("gemini_dcp: created the tier root %s (mode 0700)", path)
    check_root(path, explicit=True)


def _save_planner() -> Any:
    """DCP's default planner with its plan cache (torch >= 2.7): a per-step save of an unchanged state dict
    sends no plan again (docs/async.md); its own cache key, apart from any other saves of the job."""
    from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: PLC0415 - torch

    try:
        planner = DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:  # torch without plan caching
        return DefaultSavePlanner()
    planner._cached_plans_key = "gemini_dcp.integrations.torchtitan"  # DCP's cache is class-level
    return planner


def gemini_checkpoint_config(**fields: Any) -> Any:
    """A :class:`GeminiCheckpointManager` config (for a torchtitan config function): torchtitan's
    ``CheckpointManager.Config`` fields plus the ``gemini_*`` ones; ``enable`` defaults to True."""
    fields.setdefault("enable", True)
    return checkpoint_manager_class().Config(**fields)


def gemini_checkpoint(cfg: Any, **gemini_fields: Any) -> Any:
    """torchtitan ``--override.imports`` factory: the job's checkpoint config, as a
    :class:`GeminiCheckpointManager` config (every field kept, ``gemini_*`` fields from the import's kwargs)."""
    from torchtitan.config.override import derive  # noqa: PLC0415 - optional dependency

    unknown = sorted(k for k in gemini_fields if not k.startswith("gemini_"))
    if unknown:
        raise ConfigError(f"{OVERRIDE}: {unknown} are not gemini_* settings; torchtitan's own checkpoint "
                          "settings go on the command line (--checkpoint.interval ...).")
    return derive(cfg, checkpoint_manager_class().Config, **gemini_fields)


def _register_override() -> None:
    """Register :func:`gemini_checkpoint` with torchtitan's override registry when torchtitan is here
    (torchtitan imports this module to resolve ``--override.imports``; without torchtitan, nothing to do)."""
    if not torchtitan_available():
        return
    from torchtitan.components.checkpointer import CheckpointManager  # noqa: PLC0415 - optional dependency
    from torchtitan.config.override import _REGISTRY, override  # noqa: PLC0415

    if OVERRIDE not in _REGISTRY:
        override(target=CheckpointManager.Config, description="gemini_dcp in-memory checkpoint tiers")(
            gemini_checkpoint
        )


def __getattr__(name: str) -> Any:
    if name == "GeminiCheckpointManager":
        return checkpoint_manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register_override()

__all__ = [
    "OVERRIDE", "WRITER_FIELDS", "TitanGeminiSettings", "checkpoint_manager_class", "gemini_checkpoint",
    "gemini_checkpoint_config", "torchtitan_available",
]
