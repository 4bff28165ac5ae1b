"""fast_load: restore straight into the live state dict from the local tier, without DCP's planning.

``dcp.load`` plans every restore anew (a local plan per item, an all-gather of the plans, a
scatter, a ReadItem per chunk): at hundreds to thousands of items that planning, not the copy, is
the restore. When the state dict has exactly the structure that was saved and this rank's node
holds every chunk it needs, none of it is needed:

1. the reader's collective restore decision (``GeminiStorageReader.read_metadata``: the same step
   and copy ``dcp.load`` would restore);
2. each rank maps its state dict onto the record (:mod:`gemini_dcp.restore.fast_plan`, cached per
   structure), and one small all-reduce decides whether *every* rank can take the fast path; small
   chunks only another node holds (DCP stores a replicated value in one rank's slot) are routed to
   a rank whose node holds them (one all-gather), which verifies and sends them in step 3;
3. each rank verifies its chunks in place (:func:`gemini_dcp.core.chunk_sink.failed_spans`) and
   decodes its non-tensor values (``torch.load(weights_only=True)``); a second all-reduce agrees
   that every rank verified every chunk (with routed chunks: an all-gather that carries them, the
   receivers verify them again, and a third all-reduce agrees);
4. only then are the chunks copied into the live tensors (``torch._foreach_copy_``).

Anything else — a key, shape, dtype or sharding that differs, a chunk only a peer or the store
holds, a corrupt chunk, a value that only a full unpickler reads — falls back, on every rank, to
``dcp.load`` with the same reader, which repairs from peers and the store, converts dtypes, and
raises the clear errors. Like the reader, a fast restore is all-or-nothing.
"""

from __future__ import annotations

import gc
import io
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ..core.chunk_sink import failed_spans, land_same_dtype
from ..errors import ConfigError
from ..local.slots import ReadOnlySlot
from ..restore.fast_plan import FastEntry, FastPlan, build_plan, cached_plan, remember, walk
from ..restore.parity_restore import tier_bytes
from ..transport.comm import Comm, get_comm
from .reader import TIERS, GeminiStorageReader

__all__ = ["FastLoadResult", "fast_load"]

log = logging.getLogger(__name__)

PATHS = ("fast", "dcp")


@dataclass(frozen=True, slots=True, kw_only=True)
class FastLoadResult:
    """What :func:`fast_load` did: ``path`` ``"fast"`` (straight from the local slots) or ``"dcp"``
    (the ``dcp.load`` fallback, ``reason`` says why), the step restored, this rank's bytes read,
    ``restored_from`` (tier → bytes summed over all ranks, as the reader's) and the wall time."""

    path: str
    step: int
    nbytes: int
    restored_from: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ConfigError(f"FastLoadResult.path must be one of {PATHS}, not {self.path!r}.")
        if self.nbytes < 0 or self.seconds < 0:
            raise ConfigError("FastLoadResult.nbytes and .seconds must be >= 0.")


def fast_load(
    state_dict: dict[str, Any],
    *,
    root: str | None = None,
    job_id: str | None = None,
    storage_reader: GeminiStorageReader | None = None,
    step: int | None = None,
    process_group: Any = None,
    timeout_s: float = 300.0,
) -> FastLoadResult:
    """Restore ``state_dict`` in place from gemini_dcp's tiers; the fast path when it can.

    **All ranks must call this together** (it runs collectives on the checkpoint control group).
    ``root``/``job_id`` build a :class:`GeminiStorageReader` (or pass ``storage_reader``, not both);
    ``step``: the step to load (default: the newest restorable). Every rank takes the same path.
    Errors are those of ``dcp.load`` with a ``GeminiStorageReader`` (the fallback raises them).

    Top-level ``Stateful`` values (a trainer's app state, torchtitan's model and optimizer
    wrappers) are handled as ``dcp.load`` handles them: restored into their ``state_dict()``, then
    given back with ``load_state_dict()`` — only after a successful restore, on either path.
    """
    # Stateful is a runtime-checkable Protocol: each isinstance walks the class statically (~30 µs,
    # 20 ms at 738 top-level tensors). Tensors and plain values never are one: skip them by type.
    plain = _plain_types()
    stateful = {k: v for k, v in state_dict.items() if type(v) not in plain and isinstance(v, Stateful)}
    if stateful:
        inner = {k: (v.state_dict() if k in stateful else v) for k, v in state_dict.items()}
        result = _fast_load(inner, root, job_id, storage_reader, step, process_group, timeout_s)
        for k, obj in stateful.items():
            obj.load_state_dict(inner[k])
        for k, v in inner.items():  # a plain top-level value replaced by the load (a step counter)
            if k not in stateful:
                state_dict[k] = v
        return result
    return _fast_load(state_dict, root, job_id, storage_reader, step, process_group, timeout_s)


def _fast_load(
    state_dict: dict[str, Any], root: str | None, job_id: str | None, storage_reader: GeminiStorageReader | None,
    step: int | None, process_group: Any, timeout_s: float,
) -> FastLoadResult:
    """:func:`fast_load` of a state dict without top-level ``Stateful`` values (collective); its
    ``seconds`` (and the reader's ``restore_seconds``) are the restore's own, without ``state_dict()``
    / ``load_state_dict()`` of Stateful values around it.

    The cyclic garbage collector is paused for the restore (and resumed after it, also on an
    error, if it was running): a restore allocates a few objects per item, and at thousands of
    items that set off full collections of the whole process in its middle (one restore in four
    took 4-6x the others at 738 and 3,000 items). The collection runs at the caller's next
    allocations instead.
    """
    if not gc.isenabled():
        return _restore(state_dict, root, job_id, storage_reader, step, process_group, timeout_s)
    gc.disable()
    try:
        return _restore(state_dict, root, job_id, storage_reader, step, process_group, timeout_s)
    finally:
        gc.enable()


def _restore(
    state_dict: dict[str, Any], root: str | None, job_id: str | None, storage_reader: GeminiStorageReader | None,
    step: int | None, process_group: Any, timeout_s: float,
) -> FastLoadResult:
    """:func:`_fast_load`'s body (collective)."""
    t0 = time.perf_counter()
    if storage_reader is not None and (root is not None or job_id is not None):
        raise ConfigError("fast_load: pass either storage_reader or root/job_id, not both.")
    reader = storage_reader or GeminiStorageReader(root, job_id, timeout_s=timeout_s, process_group=process_group)
    if reader.process_group is None and process_group is not None:
        reader.process_group = process_group
    reader.reset(step)  # collective when a step is given
    reader.read_metadata()  # collective: the reader's own restore decision
    comm = get_comm(reader.timeout_s, reader.process_group)

    try:  # no error may leave one rank before the agreement: the others are in the collective
        flat, mappings = _flatten(state_dict)
        plan, dests, reason = _local_plan(reader, flat, comm.rank)
    except Exception as exc:  # noqa: BLE001 - the fallback (dcp.load) raises its own error if it is real
        flat, mappings, plan, dests, reason = state_dict, None, None, [], f"{type(exc).__name__}: {exc}"
    wants = [] if plan is None else [plan.entries[i] for i in plan.remote]
    staged: _Staged | None = None
    if not reason:  # this node's chunks are verified before the agreement: one agreement for plan and verify
        assert plan is not None
        staged = _Staged(reader, plan)
        try:
            reason = staged.verify(dests)
        except Exception as exc:  # noqa: BLE001 - told to the other ranks; the fallback reports it
            reason = f"{type(exc).__name__}: {exc}"
    reason, n_remote, total = _agree(comm, reason, "plan and verify", len(wants), plan.nbytes if plan is not None else 0)
    peer_total = 0
    if not reason and n_remote:  # small chunks only another node holds: route each to a rank whose node holds it
        assert staged is not None and plan is not None
        reason, serve = _routes(comm, set(reader.local_slots), wants)
        if not reason:
            try:
                reason = staged.serve(serve)
            except Exception as exc:  # noqa: BLE001 - told to the other ranks; the fallback reports it
                reason = f"{type(exc).__name__}: {exc}"
            reason, total, peer_total, received = _exchange(comm, reason, plan.nbytes, staged.remote_nbytes, staged.served)
            if not reason:
                reason = staged.take_remote(received, dests)
            reason, _, _ = _agree(comm, reason, "receive")
    if reason:
        if staged is not None:
            staged.close()
        log.info("fast_load: falling back to dcp.load (%s)", reason)
        return _fallback(state_dict, reader, reason, t0)

    assert staged is not None and plan is not None
    try:
        staged.land(flat, mappings, state_dict)
    finally:
        staged.close()
    nbytes = plan.nbytes
    counts = dict.fromkeys(TIERS, 0)
    counts["local"], counts["peer"] = total - peer_total, peer_total
    step_done = reader.decided_step
    assert step_done is not None
    seconds = time.perf_counter() - t0
    reader.restored_step = step_done
    reader.restored_from = tier_bytes(counts)
    reader.rank_restored_from = tier_bytes(dict(counts, local=nbytes - staged.remote_nbytes, peer=staged.remote_nbytes))
    reader.restore_seconds = seconds
    return FastLoadResult(path="fast", step=step_done, nbytes=nbytes, restored_from=dict(reader.restored_from), seconds=seconds)


_PLAIN: frozenset[type] | None = None


def _plain_types() -> frozenset[type]:
    """Types that are never ``Stateful`` (no ``state_dict``/``load_state_dict``): tensors, DTensors, scalars."""
    global _PLAIN
    if _PLAIN is None:
        types: set[type] = {torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, type(None)}
        try:
            from torch.distributed.tensor import DTensor  # noqa: PLC0415
        except ImportError:  # a torch built without distributed
            pass
        else:
            types.add(DTensor)
        _PLAIN = frozenset(types)
    return _PLAIN


# ---- the steps ------------------------------------------------------------------------------------
def _flatten(state_dict: dict[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any] | None]:
    """The state dict as DCP flattens it (and the paths back), or itself when already flat."""
    plain = _plain_types()  # an ABC isinstance per value is the slow part: tensors skip it by type
    if not any(type(v) not in plain and isinstance(v, (Mapping, list, tuple)) for v in state_dict.values()):
        return state_dict, None
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    flat, mappings = flatten_state_dict(state_dict)
    return flat, dict(mappings)


def _local_plan(
    reader: GeminiStorageReader, flat: Mapping[str, Any], rank: int
) -> tuple[FastPlan | None, list[torch.Tensor | None], str]:
    """This rank's plan and destinations, or why this rank cannot take the fast path (no collective)."""
    # The reader's decision: the record and the slots this node holds.
    decision, record = reader.decision, reader.record
    if decision is None or record is None or decision.fingerprint is None:
        return None, [], "the step is restored from the persistent tier"
    if decision.rebuilt:
        return None, [], "slots are rebuilt from parity"
    walked = walk(flat)
    if walked.reason:
        return None, [], walked.reason
    key = (str(reader.root), reader.job_id, rank, decision.fingerprint, frozenset(reader.local_slots))
    plan = cached_plan(key, walked.signature)
    if plan is None:
        built = build_plan(flat, walked, record.metadata, decision.fingerprint, set(reader.local_slots))
        if isinstance(built, str):
            return None, [], built
        plan = built
        remember(key, plan)
    return plan, walked.dests, ""


class _Staged:
    """One rank's fast restore between verify and land: the mapped slots and the decoded values."""

    def __init__(self, reader: GeminiStorageReader, plan: FastPlan) -> None:
        self.reader = reader
        self.plan = plan
        self.slots: dict[int, ReadOnlySlot] = {}
        self.values: dict[str, Any] = {}
        self.srcs: list[torch.Tensor] = []
        self.dests: list[torch.Tensor] = []
        self.served: dict[tuple[int, int], bytes] = {}  # (saving rank, offset) -> verified bytes for another rank
        self.remote_nbytes = sum(plan.entries[i].length for i in plan.remote)  # bytes this rank gets from peers

    def verify(self, walked_dests: list[torch.Tensor | None]) -> str:
        """Map the slots, verify every chunk and decode the non-tensor values; why not, or ""."""
        by_slot: dict[int, list[int]] = {}
        remote = set(self.plan.remote)
        for i, e in enumerate(self.plan.entries):
            if i not in remote:
                by_slot.setdefault(e.slot_rank, []).append(i)
        views = self.plan.views
        for slot_rank, idx in by_slot.items():
            entries = [self.plan.entries[i] for i in idx]
            got = self._verified_slot(slot_rank, entries)
            if isinstance(got, str):
                return got
            slot, mv = got
            typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # the slot viewed as each dtype, once
            for i, e in zip(idx, entries):
                dest = walked_dests[i]
                if e.is_bytes:
                    why = self._decode(e, bytes(mv[e.offset : e.offset + e.length]))
                    if why:
                        return why
                elif dest is None:
                    continue
                elif views:  # the verified span [e.offset, e.offset + e.length), as the tensor it holds
                    v = views[i]
                    if v is None:
                        continue
                    got_typed = typed.get(v.dtype)
                    if got_typed is None:
                        got_typed = typed[v.dtype] = _as_dtype(slot.tensor, v.dtype)
                    base, start = got_typed
                    self.dests.append(dest)
                    self.srcs.append(base.as_strided(v.shape, v.stride, start + v.elem_offset))
                elif dest.numel():
                    self.dests.append(dest)
                    self.srcs.append(slot.tensor[e.offset : e.offset + e.length].view(dest.dtype).view(dest.shape))
        return ""

    def serve(self, entries: list[FastEntry]) -> str:
        """Read and verify the small chunks other ranks' nodes lack (kept in ``served``); why not, or ""."""
        by_slot: dict[int, list[FastEntry]] = {}
        for e in entries:
            by_slot.setdefault(e.slot_rank, []).append(e)
        for slot_rank, es in by_slot.items():
            got = self._verified_slot(slot_rank, es)
            if isinstance(got, str):
                return got
            mv = got[1]
            for e in es:
                self.served[(e.slot_rank, e.offset)] = bytes(mv[e.offset : e.offset + e.length])
        return ""

    def take_remote(self, received: Mapping[tuple[int, int], bytes], walked_dests: list[torch.Tensor | None]) -> str:
        """Verify (untrusted: they came from a peer) and hold the small chunks sent to this rank."""
        for i in self.plan.remote:
            e = self.plan.entries[i]
            raw = received.get((e.slot_rank, e.offset))
            if raw is None or len(raw) != e.length or failed_spans(memoryview(raw), [(0, e.length, e.algo, e.checksum)]):
                return f"{e.fqn!r}: the copy sent by a peer is missing or fails its {e.algo} checksum"
            dest = walked_dests[i]
            if e.is_bytes:
                why = self._decode(e, raw)
                if why:
                    return why
            elif dest is not None and dest.numel():
                self.dests.append(dest)
                self.srcs.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dest.dtype).view(dest.shape))
        return ""

    def _verified_slot(self, slot_rank: int, entries: list[FastEntry]) -> tuple[ReadOnlySlot, memoryview] | str:
        """This node's slot of ``slot_rank`` mapped, with ``entries`` verified in it; or why not."""
        slot = self.slots.get(slot_rank)
        if slot is None:
            try:
                slot = self.slots[slot_rank] = ReadOnlySlot(self.reader.local_slots[slot_rank])
            except (OSError, KeyError) as exc:
                return f"slot of rank {slot_rank} unreadable: {exc}"
        lo = min(e.offset for e in entries)
        hi = max(e.offset + e.length for e in entries)
        if hi > slot.size:
            return f"slot of rank {slot_rank} is shorter than its record says"
        if hi > lo:
            slot.view(lo, hi - lo)  # populate the pages read, once
        mv = slot.tensor.numpy().data if slot.size else memoryview(b"")
        bad = failed_spans(mv, [(e.offset, e.length, e.algo, e.checksum) for e in entries])
        if bad:
            e = entries[bad[0]]
            log.warning("fast_load: %r (step %s, slot of rank %d) failed its %s checksum; falling back",
                        e.fqn, self.reader.decided_step, slot_rank, e.algo)
            return f"{len(bad)} corrupt chunk(s), first {e.fqn!r}"
        return slot, mv

    def _decode(self, e: FastEntry, raw: bytes) -> str:
        """A non-tensor value from its verified ``torch.save`` bytes (restricted: ``weights_only``)."""
        try:
            self.values[e.fqn] = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - an object only a full unpickler reads: dcp.load's way
            return f"{e.fqn!r}: not readable with weights_only=True ({type(exc).__name__})"
        return ""

    def land(self, flat: Mapping[str, Any], mappings: dict[str, Any] | None, state_dict: dict[str, Any]) -> None:
        """Every rank verified: copy the chunks into the live tensors, set the non-tensor values."""
        land_same_dtype(self.dests, self.srcs)
        if not self.values:
            return
        if mappings is None:
            state_dict.update(self.values)
            return
        from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

        for fqn, value in self.values.items():
            set_element(state_dict, mappings[fqn], value)

    def close(self) -> None:
        self.srcs.clear()
        self.dests.clear()
        self.values.clear()
        self.served.clear()
        self.slots.clear()  # the mappings go with their last view


def _as_dtype(slot_bytes: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A slot's bytes (flat uint8) viewed as ``dtype`` (its whole elements), and the storage offset
    (in elements) of its first byte: ``as_strided`` offsets count from the storage's start."""
    size = torch.empty((), dtype=dtype).element_size()
    usable = slot_bytes.numel() - slot_bytes.numel() % size
    typed = slot_bytes[:usable].view(dtype)
    return typed, int(typed.storage_offset())


def _routes(comm: Comm, held: set[int], wants: list[FastEntry]) -> tuple[str, list[FastEntry]]:
    """Collective (one all-gather): which small chunks this rank sends to others (each by the lowest
    rank whose node holds its slot), or the reason — the same on every rank — that some has no holder."""
    gathered = comm.all_gather_object((sorted(held), wants))
    serve: dict[tuple[int, int], FastEntry] = {}
    for requester, (_, theirs) in enumerate(gathered):
        for e in theirs:
            server = next((r for r, (h, _) in enumerate(gathered) if e.slot_rank in h), None)
            if server is None:
                return f"{e.fqn!r} (needed by rank {requester}) is in no live node's memory", []
            if server == comm.rank:
                serve[(e.slot_rank, e.offset)] = FastEntry(*e)
    return "", list(serve.values())


def _exchange(
    comm: Comm, reason: str, nbytes: int, remote_nbytes: int, served: dict[tuple[int, int], bytes]
) -> tuple[str, int, int, dict[tuple[int, int], bytes]]:
    """Collective (one all-gather): every rank's verdict, byte counts (all, from peers) and the small
    chunks it serves; returns (reason, total bytes, total from peers, the chunks)."""
    gathered = comm.all_gather_object((reason, nbytes, remote_nbytes, served))
    received: dict[tuple[int, int], bytes] = {}
    for *_, theirs in gathered:
        received.update(theirs)
    failed = sum(1 for g in gathered if g[0])
    total = sum(g[1] for g in gathered)
    peer_total = sum(g[2] for g in gathered)
    if failed:
        return reason or f"{failed} other rank(s) cannot take the fast path (verify)", total, peer_total, received
    return "", total, peer_total, received


def _agree(comm: Comm, reason: str, what: str, n_remote: int = 0, nbytes: int = 0) -> tuple[str, int, int]:
    """Collective (one small all-reduce): ("", ``n_remote`` and ``nbytes`` summed over ranks) when no rank has
    a reason to fall back, else (this rank's reason or a note naming how many others have one, the sums)."""
    if not comm.distributed:
        return reason, n_remote, nbytes
    t = torch.tensor([1 if reason else 0, n_remote, nbytes], dtype=torch.int64)
    comm.run(f"fast_load {what} agreement", dist.all_reduce, t, op=dist.ReduceOp.SUM, group=comm.group)
    failed, remote, total = (int(x) for x in t.tolist())
    if failed == 0:
        return "", remote, total
    return reason or f"{failed} other rank(s) cannot take the fast path ({what})", remote, total


def _fallback(state_dict: dict[str, Any], reader: GeminiStorageReader, reason: str, t0: float) -> FastLoadResult:
    """Collective: ``dcp.load`` with the reader that already decided (its decision is reused)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    dcp.load(state_dict, storage_reader=reader, process_group=reader.process_group)
    step = reader.restored_step
    assert step is not None
    return FastLoadResult(
        path="dcp", step=step, nbytes=sum(reader.rank_restored_from.values()),
        restored_from=dict(reader.restored_from), reason=reason, seconds=time.perf_counter() - t0,
    )
