"""DeepSpeed (ZeRO-0/1/2/3): every ``engine.save_checkpoint`` into gemini_dcp's tiers, every ``load_checkpoint`` out.

One call after ``deepspeed.initialize``, on every rank; the training loop stays as it was::

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    use_gemini(engine, job_id="run1")              # options: as GeminiStorageWriter's keywords
    engine.load_checkpoint("ckpt")                 # newest restorable step in any tier; (None, None): none
    for batch in data:
        engine.backward(engine(batch)); engine.step()
        engine.save_checkpoint("ckpt")             # one atomic gemini_dcp step (tag global_step<N>)

What it does (DeepSpeed 0.19; the probe and the source it reads: deepspeed/runtime/engine.py):

- **One checkpoint, one step.** DeepSpeed routes every file of a checkpoint through its
  ``engine.checkpoint_engine`` (``create(info)``, ``save(state_dict, path)`` per file, ``commit(info)``);
  :class:`GeminiCheckpointEngine` buffers the files a rank saves and at ``commit`` makes one collective save
  of all of them as step ``engine.global_steps``: every rank's files commit together or not at all. The
  tag is recorded with the step (``gemini_dcp.persistent.deepspeed_layout``); a second checkpoint at the same
  global step in one launch is refused with :class:`~gemini_dcp.errors.ConfigError` (one checkpoint per step).
- **Load.** DeepSpeed's ``load_checkpoint`` reads ``load_dir/latest``, globs and ``os.path.exists``-checks
  the per-rank files on the file system itself, outside the engine, so :func:`use_gemini` wraps it: with no
  tag it asks the tiers for the newest restorable step (memory, peers, persistent tier; unhealthy steps
  passed over), with a tag for the step recorded with it; then one collective ``dcp.load`` of the files this
  rank reads (its own ZeRO partitions and the shared model states) and DeepSpeed's own load runs on a private
  directory of empty stand-in files (removed afterwards) while the engine serves their contents. So a
  replacement node whose checkpoint directory is empty or gone resumes; nothing is written into
  ``load_dir``. With nothing in the tiers, DeepSpeed's own load runs on ``load_dir`` unchanged (a first
  launch returns ``(None, None)``; a checkpoint written to disk by DeepSpeed itself still loads).
- **World size.** ZeRO partitions are per rank; a step saved by another number of ranks is refused with
  :class:`~gemini_dcp.errors.WorldSizeError` naming the conversion (``gemini-dcp export --format
  deepspeed``, then DeepSpeed's universal checkpoint), never loaded wrongly.
- **save_16bit_model** (and ``save_fp16_model``) never becomes a training step: it writes its file to disk
  with ``torch.save`` as DeepSpeed's own engine does (its own namespace: the path it is given).
- **async_save=True**: ``commit`` hands the files to :class:`gemini_dcp.AsyncCheckpointer` and returns; the
  copy overlaps the next forward/backward, and the base optimizer's next ``step()`` waits until this rank's
  bytes are in the tier (the tensors the ZeRO optimizers change are changed in or after that step; the
  module's buffers are cloned at the save). The crash bound: before handing over step N, ``commit`` waits
  until every earlier checkpoint committed (``AsyncCheckpointer``'s ``max_pending=1``), so when
  ``save_checkpoint(N)`` returns at most checkpoint N is uncommitted and a crash resumes from N or N - 1. The
  copy is paced into the gaps between training collectives only for a model on an accelerator
  (``gemini_dcp.snapshot.interleave.interleave_for``); a CPU model's copy goes at once. Call
  ``engine.checkpoint_engine.close()`` (or ``engine.destroy()``) after the last save.

Not kept: DeepSpeed keeps no RNG state in its checkpoints (put it in ``client_state``); NVMe-offloaded
optimizer files (``offloaded_tensors/``) and ``load_universal_checkpoint`` read the file system directly and
are not routed; ZeRO-3 ``load_checkpoint(load_optimizer_states=False)`` / ``load_module_only=True`` would
consolidate from files on disk and are refused with :class:`~gemini_dcp.errors.ConfigError`.

Collective: ``save_checkpoint``, ``load_checkpoint`` and ``close`` run on every rank, as DeepSpeed requires.
DeepSpeed is never imported here (``import gemini_dcp`` never needs it): the engine implements DeepSpeed's
``CheckpointEngine`` interface without subclassing it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..dcp.discovery import newest_restorable_step
from ..dcp.reader import GeminiStorageReader
from ..dcp.writer import GeminiStorageWriter
from ..errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
    UntrustedDataError,
    WorldSizeError,
)
from ..persistent.deepspeed_layout import (
    TAG_KEY,
    StoredFile,
    decode_file,
    deepspeed_files,
    empty_state,
    file_items,
    is_deepspeed_step,
    tag_item,
    tag_template,
    tag_value,
)
from ..transport.comm import get_comm

GLOBAL_STEP_TAG = re.compile(r"global_step([0-9]+)")
_ZERO_RANK = re.compile(r"zero_pp_rank_([0-9]+)_")


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer at the bottom of DeepSpeed's wrappers (ZeRO, BF16_Optimizer...): its step is where
    the saved tensors change, so the async guard hooks it."""
    found = None
    for _ in range(8):
        if isinstance(optimizer, torch.optim.Optimizer):
            found = optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            break
    return found


class GeminiCheckpointEngine:
    """DeepSpeed's ``CheckpointEngine`` over gemini_dcp's tiers: install it with :func:`use_gemini`.

    ``async_save``: hand each checkpoint to :class:`gemini_dcp.AsyncCheckpointer` (see the module docstring);
    ``optimizer`` / ``model``: what its guard hooks and whose buffers it clones (``use_gemini`` passes the
    engine's). ``options``: :class:`gemini_dcp.GeminiStorageWriter`'s keywords (``job_id``, ``root``,
    ``replicas``, ``parity_group``, ``persistent``, ``persist_every``, ``keep``, ``nonfinite``,
    ``options=GeminiOptions(...)``...); set ``job_id`` so a relaunch finds its steps.

    ``writer`` / ``reader``: the gemini_dcp writer and reader; after a load ``restored_step``, ``restored_from``
    and ``restore_seconds`` (the names the Accelerate, Lightning and torchtitan integrations use); ``steps``:
    step -> tag of the checkpoints this launch committed or handed over.
    """

    name = "GeminiCheckpointEngine"

    def __init__(self, *, async_save: bool = False, optimizer: Any = None, model: Any = None, **options: Any) -> None:
        if not isinstance(async_save, bool):
            raise ConfigError(f"async_save={async_save!r}: give True (copy during the next step) or False.")
        self.writer = GeminiStorageWriter(**options)
        self.reader = GeminiStorageReader(options=self.writer.options, process_group=self.writer.process_group)
        self.async_save = async_save
        self._guard = _innermost_optimizer(optimizer)
        self._model = model
        self._snapshots: Any = None
        self._engine: Any = None  # the DeepSpeed engine (use_gemini): global_steps names the step
        self._model_file_save = False  # inside save_16bit_model: files go to disk, no step
        self._info: Any = None
        self._pending: dict[str, torch.Tensor] = {}
        self._loading: tuple[str, dict[str, StoredFile], dict[str, torch.Tensor]] | None = None
        self.steps: dict[int, str] = {}
        self.restored_step: int | None = None
        """The gemini_dcp step the last ``load_checkpoint`` restored (None: nothing came from the tiers)."""
        self.restored_from: dict[str, int] = {}
        """Bytes read per tier (``local``, ``peer``, ``parity``, ``persistent``) by the last ``load_checkpoint``, summed
        over the ranks (``GeminiStorageReader.restored_from``); empty when nothing came from the tiers."""
        self.last_save_seconds: float | None = None
        """Wall seconds this rank spent in the engine for the last checkpoint (its ``save`` calls and ``commit``;
        with ``async_save`` the hand-over, not the copy): gemini_dcp's part of ``save_checkpoint``."""
        self._save_s = 0.0
        self.restore_seconds: float | None = None
        """Wall seconds of the last ``load_checkpoint`` from the tiers (finding the step, reading it, DeepSpeed's load)."""

    # ---- DeepSpeed's CheckpointEngine interface ------------------------------------------------------
    def create(self, info: Any) -> None:
        """A checkpoint ``info.tag`` begins (every rank)."""
        self._info = None if self._model_file_save else info
        self._pending, self._save_s = {}, 0.0

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Directories of a training checkpoint's tag live in the tiers, not on disk; others are made."""
        if self._info is not None and _below(path, self._tag_dir()):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Take one file of the checkpoint (its non-tensor values as they are now, its tensors by reference);
        a file outside the tag directory (``save_16bit_model``) is written to disk as DeepSpeed would."""
        if self._info is None or not _below(path, self._tag_dir()):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.save(state_dict, path)
            return
        begin = time.perf_counter()
        name = os.path.relpath(path, self._tag_dir()).replace(os.sep, "/")
        self._pending.update(file_items(_rank(), name, state_dict))
        self._save_s += time.perf_counter() - begin

    def commit(self, info: Any) -> bool:
        """Collective: every rank's files of the checkpoint as one gemini_dcp step (see the module docstring)."""
        if self._info is None:  # save_16bit_model: its file went to disk
            return True
        begin = time.perf_counter()
        tag = str(info.tag)
        pending, self._pending, self._info = self._pending, {}, None
        spent, self._save_s = self._save_s, 0.0
        step = self._step_for(tag)
        if step in self.steps:
            raise ConfigError(
                f"DeepSpeed checkpoint {tag!r} is at global step {step}, which this launch already checkpointed as "
                f"{self.steps[step]!r}: gemini_dcp keeps one checkpoint per global step. Save again after the next "
                "engine.step(), or give the earlier checkpoint's tag."
            )
        state = {**tag_item(tag), **pending}
        if self.async_save:  # waits until the previous checkpoint committed (max_pending=1): the crash bound
            self._checkpointer().save(state, step)
        else:
            dcp.save(state, storage_writer=self.writer, checkpoint_id=step)
        self.steps[step] = tag
        self.last_save_seconds = spent + time.perf_counter() - begin
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """A file of the checkpoint being loaded (from the tiers), else the file on disk (``torch.load``)."""
        if self._loading is not None and _below(path, self._loading[0]):
            base, files, values = self._loading
            name = os.path.relpath(path, base).replace(os.sep, "/")
            f = files.get(name)
            if f is None or f.keys[0] not in values:
                raise CheckpointNotFoundError(
                    f"DeepSpeed asked for {name!r}, which gemini_dcp did not read for rank {_rank()} (its own ZeRO "
                    f"partitions and the shared files; the step holds {sorted(files)}). Report it: this load path "
                    "reads files gemini_dcp.integrations.deepspeed does not expect."
                )
            return decode_file(f, values)
        return torch.load(path, map_location=map_location, weights_only=False)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return bool(dp_rank == 0)

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: Any) -> None:
        pass

    def get_commit_info(self) -> None:
        return None

    def cleanup(self) -> None:
        self.close()

    def preserves_storage_sharing(self) -> bool:
        """False: each tensor is stored as its own item (views are not stored as their whole storage)."""
        return False

    # ---- beyond DeepSpeed's interface ---------------------------------------------------------------
    def wait(self) -> None:
        """Block until every handed-over checkpoint committed (``async_save``); raise a background error."""
        if self._snapshots is not None:
            self._snapshots.wait()

    def close(self) -> None:
        """Wait for the last checkpoint and stop the background thread (``async_save``). Every rank."""
        if self._snapshots is not None:
            snapshots, self._snapshots = self._snapshots, None
            snapshots.close()

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this launch committed (``async_save``: as the background thread reports)."""
        if self._snapshots is not None:
            return self._snapshots.last_committed_step  # type: ignore[no-any-return]
        return max(self.steps) if self.steps else None

    @contextlib.contextmanager
    def model_file_save(self) -> Iterator[None]:
        """Within it, ``create/save/commit`` write files to disk and make no step (``save_16bit_model``)."""
        self._model_file_save = True
        try:
            yield
        finally:
            self._model_file_save = False

    def load_checkpoint(self, load: Callable[..., Any], load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Collective: DeepSpeed's ``load_checkpoint`` (``load``) served from the tiers (see the module docstring)."""
        begin = time.perf_counter()
        self.wait()
        self.restored_step, self.restored_from, self.restore_seconds = None, {}, None
        step = self._resolve(None if tag is None else str(tag))
        if step is None:
            return self._load_from_disk(load, load_dir, tag, *args, **kwargs)
        self._check_loadable(step, kwargs)
        metadata = self.reader.read_metadata()
        files = deepspeed_files(metadata)
        wanted = self._files_to_read(files)
        values = {**tag_template(), **empty_state(metadata, [k for f in wanted for k in f.keys])}
        dcp.load(values, storage_reader=self.reader, checkpoint_id=step)
        found = tag_value(values[TAG_KEY])
        if tag is not None and found != str(tag):  # _resolve checked it: the step changed under us
            raise CheckpointMismatchError(f"gemini_dcp step {step} now holds DeepSpeed checkpoint {found!r}, not {str(tag)!r}.")
        if not found or os.path.normpath(found) != found or found.startswith(("/", "..")):
            raise UntrustedDataError(f"gemini_dcp step {step} records DeepSpeed tag {found!r}, which is no directory name.")
        stand_ins = tempfile.mkdtemp(prefix="gemini_dcp-deepspeed-")
        try:
            for name in files:  # what DeepSpeed globs and checks for, empty
                p = os.path.join(stand_ins, found, *name.split("/"))
                if not _below(p, os.path.join(stand_ins, found)):
                    raise CheckpointMismatchError(f"step {step} holds a DeepSpeed file named {name!r}, outside its tag directory.")
                os.makedirs(os.path.dirname(p), exist_ok=True)
                open(p, "wb").close()
            self._loading = (os.path.join(stand_ins, found), files, values)
            load_path, client_state = load(stand_ins, found, *args, **kwargs)
        finally:
            self._loading = None
            shutil.rmtree(stand_ins, ignore_errors=True)
        if isinstance(load_path, str) and _below(load_path, stand_ins):
            load_path = os.path.join(load_dir, os.path.relpath(load_path, stand_ins))
        self.restored_step, self.restored_from = step, dict(self.reader.restored_from)
        self.restore_seconds = time.perf_counter() - begin
        return load_path, client_state

    # ---- internals ----------------------------------------------------------------------------------
    def _tag_dir(self) -> str:
        return os.path.join(self._info.save_dir, str(self._info.tag))

    def _step_for(self, tag: str) -> int:
        if self._engine is not None:
            return int(self._engine.global_steps)
        m = GLOBAL_STEP_TAG.fullmatch(tag)
        if m is None:
            raise ConfigError(f"tag {tag!r}: without the DeepSpeed engine (install with use_gemini(engine)) only "
                              "tags global_step<N> name a step.")
        return int(m.group(1))

    def _checkpointer(self) -> Any:
        if self._snapshots is None:  # collective (its control group): every rank commits together
            from ..snapshot.checkpointer import AsyncCheckpointer  # noqa: PLC0415
            from ..snapshot.interleave import interleave_for  # noqa: PLC0415

            # paced into the gaps between training collectives only for a model on an accelerator (GEMINI's
            # case); a CPU model's copy goes at once, as in the Accelerate and torchtitan adapters
            pace = self._model is not None and interleave_for(self._model)
            self._snapshots = AsyncCheckpointer(self.writer, optimizer=self._guard, model=self._model, interleave=pace)
        return self._snapshots

    def _resolve(self, tag: str | None) -> int | None:
        """Collective: the step of the checkpoint to load from the tiers (``tag``'s, else the newest), or None."""
        if tag is None:
            step = newest_restorable_step(self.reader)
            if step is not None and not is_deepspeed_step(self.reader.read_metadata()):
                raise CheckpointMismatchError(
                    f"step {step} of gemini_dcp job {self.writer.job_id!r} holds no DeepSpeed checkpoint (another "
                    "program saved it): give this DeepSpeed job a job_id of its own."
                )
            return step
        for step in self._candidate_steps(tag):
            if newest_restorable_step(self.reader, step, has_fallback=True) is None:
                continue
            if not is_deepspeed_step(self.reader.read_metadata()):
                continue
            item = tag_template()
            dcp.load(item, storage_reader=self.reader, checkpoint_id=step)
            if tag_value(item[TAG_KEY]) == tag:
                return step
        return None

    def _check_loadable(self, step: int, kwargs: dict[str, Any]) -> None:
        """Refuse, before reading anything, a load DeepSpeed could not do right from the tiers."""
        decision = self.reader.decision
        world = dist.get_world_size(self.writer.process_group) if dist.is_initialized() else 1
        if decision is not None and decision.world_size != world:
            job = self.writer.job_id
            raise WorldSizeError(
                f"gemini_dcp step {step} of job {job!r} (a DeepSpeed checkpoint) was saved by {decision.world_size} "
                f"ranks; this job has {world}. ZeRO partitions its optimizer state per rank, so the step cannot be "
                f"loaded at another world size. Convert it: `gemini-dcp export {step} --format deepspeed --to OUT "
                f"--job {job}` (on a node holding the step, or with --persistent) writes DeepSpeed's checkpoint "
                "directory OUT (latest, <tag>/); `python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                "OUT/<tag> --output_folder OUT/<tag>_universal` makes a universal checkpoint, which DeepSpeed loads at "
                "any world size with \"checkpoint\": {\"load_universal\": true} in its config and "
                "engine.load_checkpoint(\"OUT\", tag=\"<tag>_universal\") before use_gemini. Or relaunch with "
                f"{decision.world_size} ranks."
            )
        engine = self._engine
        weights_partitioned = bool(engine is not None and engine.zero_optimization_partition_weights())
        if weights_partitioned and (kwargs.get("load_module_only") or kwargs.get("load_optimizer_states") is False):
            raise ConfigError(
                "load_checkpoint(load_optimizer_states=False / load_module_only=True) under ZeRO-3: DeepSpeed then "
                "consolidates the weights from the checkpoint directory on disk (zero_to_fp32), which gemini_dcp does "
                "not write. Load the whole checkpoint, or export the step (`gemini-dcp export STEP --format deepspeed`) "
                "and load that directory with DeepSpeed's own engine."
            )

    def _candidate_steps(self, tag: str) -> list[int]:
        """Collective: every step of the job held in any tier, newest first (``global_step<N>``'s N first)."""
        comm = get_comm(self.writer.options.timeout_s, self.writer.process_group)
        mine = set(self.writer.tier.steps())
        if self.writer.persistent is not None and comm.rank == 0:
            mine.update(self.writer.persistent.committed_steps())
        steps = sorted({s for part in comm.all_gather_object(sorted(mine)) for s in part}, reverse=True)
        m = GLOBAL_STEP_TAG.fullmatch(tag)
        if m is not None and int(m.group(1)) in steps:
            steps.remove(int(m.group(1)))
            steps.insert(0, int(m.group(1)))
        return steps

    def _files_to_read(self, files: dict[str, StoredFile]) -> list[StoredFile]:
        """The files this rank's DeepSpeed load reads: the shared ones, and of the per-partition
        ``zero_pp_rank_<d>_`` files its own (all of them with ZeRO's ``elastic_checkpoint``)."""
        engine = self._engine
        elastic = bool(engine is not None and getattr(engine, "zero_elastic_checkpoint", lambda: False)())
        group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
        mine = dist.get_rank(group=group) if dist.is_initialized() else 0
        out = []
        for f in files.values():
            m = _ZERO_RANK.search(os.path.basename(f.name))
            if elastic or m is None or int(m.group(1)) == mine:
                out.append(f)
        return out

    def _load_from_disk(self, load: Callable[..., Any], load_dir: str, tag: Any, *args: Any, **kwargs: Any) -> Any:
        """Collective: nothing in the tiers. DeepSpeed's own load of ``load_dir`` (a first launch: ``(None, None)``),
        unless ``load_dir`` names a checkpoint it does not hold on some rank: then every rank raises."""
        where = f"gemini_dcp's tiers (job {self.writer.job_id!r}, root {self.writer.root}" + (
            f", persistent {self.writer.options.persistent.url}" if self.writer.persistent is not None else "") + ")"
        problem = ""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.isfile(latest):
                with open(latest) as fh:
                    named = fh.read().strip()
                if not _has_files(os.path.join(load_dir, named)):
                    problem = (f"{latest} names checkpoint {named!r}, which neither {where} nor {load_dir} hold: its "
                               "copies are gone (every node's memory, no persistent tier). Give persistent= to keep "
                               f"steps beyond the nodes' memory; to start afresh, remove {latest}.")
        elif not _has_files(os.path.join(load_dir, str(tag))):
            problem = f"DeepSpeed checkpoint {str(tag)!r} is held neither by {where} nor in {load_dir}."
        comm = get_comm(self.writer.options.timeout_s, self.writer.process_group)
        problems = [p for p in comm.all_gather_object(problem) if p]
        if problems:
            raise CheckpointNotFoundError(problem or f"on another rank: {problems[0]}")
        return load(load_dir, tag, *args, **kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _below(path: str, base: str) -> bool:
    path, base = os.path.abspath(path), os.path.abspath(base)
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def _has_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.scandir(path))


def use_gemini(engine: Any, *, async_save: bool = False, **options: Any) -> GeminiCheckpointEngine:
    """Route ``engine``'s checkpoints through gemini_dcp's tiers; returns the installed :class:`GeminiCheckpointEngine`.

    Call on every rank after ``deepspeed.initialize`` and before the first ``load_checkpoint``. ``options``:
    :class:`gemini_dcp.GeminiStorageWriter`'s keywords (``job_id``, ``root``, ``replicas``, ``parity_group``,
    ``persistent``, ``persist_every``, ``keep``, ``nonfinite``, ``options``...); ``async_save``: see the module
    docstring. Installs the engine as ``engine.checkpoint_engine`` and wraps ``engine.load_checkpoint``
    (served from the tiers), ``engine.save_16bit_model`` (to disk, never a step) and ``engine.destroy``
    (closes the engine) on this engine object only.
    """
    if getattr(engine, "checkpoint_engine", None) is None or not hasattr(engine, "load_checkpoint"):
        raise ConfigError(f"use_gemini({type(engine).__name__}): give the engine deepspeed.initialize returned.")
    if isinstance(engine.checkpoint_engine, GeminiCheckpointEngine):
        raise ConfigError("use_gemini: this engine already checkpoints through gemini_dcp (call it once per engine).")
    ce = GeminiCheckpointEngine(async_save=async_save, optimizer=getattr(engine, "optimizer", None),
                                model=getattr(engine, "module", None), **options)
    ce._engine = engine
    engine.checkpoint_engine = ce
    load, save_model, destroy = engine.load_checkpoint, engine.save_16bit_model, engine.destroy

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        return ce.load_checkpoint(load, load_dir, tag, *args, **kwargs)

    @functools.wraps(save_model)
    def save_16bit_model(*args: Any, **kwargs: Any) -> Any:
        with ce.model_file_save():
            return save_model(*args, **kwargs)

    @functools.wraps(destroy)
    def destroy_engine(*args: Any, **kwargs: Any) -> Any:
        ce.close()
        return destroy(*args, **kwargs)

    engine.load_checkpoint, engine.save_16bit_model, engine.destroy = load_checkpoint, save_16bit_model, destroy_engine
    return ce


__all__ = ["GeminiCheckpointEngine", "use_gemini"]
