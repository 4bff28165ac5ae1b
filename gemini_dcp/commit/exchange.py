"""The commit gather in one round: every rank's report through one fixed-size all-gather.

``torch.distributed.all_gather_object`` runs two collectives per call (every rank's pickled
size, then the pickles padded to the largest). The commit gather of a save (step 3 of
:mod:`gemini_dcp.commit.protocol`) sends small reports (a compact one: a few bytes per
item), so :func:`gather_objects` sends every rank's pickle in a buffer of a fixed size that
every rank computes alike from the world size (:func:`frame_bytes`): one all-gather when
every pickle fits, and a second one, sized by the largest pickle the first one announced,
only when some rank's does not. Each frame starts with the pickle's length, so every rank
knows after the first round, from the same data, whether the second one runs.

The values and the order are those of ``all_gather_object`` (group rank order). Unlike
``all_gather_object``, what arrives is not trusted as code: every frame is decoded with
:func:`gemini_dcp.core.safe_pickle.restricted_loads` resolving only the classes a commit report
holds (:data:`REPORT_GLOBALS`), and an announced length beyond :data:`MAX_REPORT_BYTES` is
refused before anything is allocated for it. Bytes on the control group's wire (a process
that joined the store by mistake, a corrupted frame) therefore never run as code; a refusal
is :class:`~gemini_dcp.errors.UntrustedDataError` on every rank alike when a length is bad
(every rank sees the same lengths) and on every rank that decodes the bad frame otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from ..transport import wire

T = TypeVar("T")

#: The globals a commit report (:class:`gemini_dcp.commit.reports.RankReport` and what it
#: holds) may name, beyond :data:`gemini_dcp.core.safe_pickle.ALLOWED_GLOBALS` (the record
#: and DCP metadata classes). Plain containers, numbers, strings and bytes need no entry.
REPORT_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("gemini_dcp.commit.reports", "RankReport"),
        ("gemini_dcp.local.record_types", "ChecksumOverlay"),
        ("torch.distributed.checkpoint.storage", "WriteResult"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        # save.local_write.WriteResults pickles as tuple(list): called with decoded values
        # (only allow-listed classes and plain data), tuple() only builds a value
        ("builtins", "tuple"),
    }
)

#: The longest pickle one rank may announce in a gather (a full report of 100,000 items
#: pickles to ~25 MiB; an inline metadata blob is at most 16 MiB): a longer announced
#: length is a corrupt or foreign frame and is refused before the second round allocates it.
MAX_REPORT_BYTES = 256 << 20

#: The most bytes one gather's frames take on each rank, all ranks together; a frame is
#: between :data:`MIN_FRAME` and :data:`MAX_FRAME` bytes (a compact report of 3,000 items
#: pickles to ~30 KiB).
FRAMES_BUDGET = 4 << 20
MIN_FRAME = 4 << 10
MAX_FRAME = 64 << 10
_LEN = struct.Struct("<Q")


class GatherGroup(Protocol):
    """What :func:`gather_objects` needs of the control group (:class:`gemini_dcp.transport.comm.Comm`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def group(self) -> Any: ...

    def all_gather_object(self, obj: T) -> list[T]: ...

    def run(self, what: str, fn: Any, *args: Any, peer: int | None = None, **kwargs: Any) -> Any: ...


def frame_bytes(world_size: int) -> int:
    """The size of one rank's frame in the first round: the same on every rank."""
    return max(MIN_FRAME, min(MAX_FRAME, FRAMES_BUDGET // max(world_size, 1)))


def gather_objects(
    comm: GatherGroup,
    obj: T,
    what: str = "all_gather_object (commit reports)",
    allowed: Collection[tuple[str, str]] = REPORT_GLOBALS,
) -> list[T]:
    """Collective over ``comm``'s group (all ranks call it, each with its own ``obj``): every
    rank's ``obj``, in group rank order, as ``comm.all_gather_object`` returns them, in one
    all-gather when every rank's pickle fits :func:`frame_bytes` (else two).

    Every frame, this rank's own included, is decoded with ``restricted_loads`` resolving only
    ``allowed`` (plus the record and DCP metadata classes); anything else, or an announced
    length over :data:`MAX_REPORT_BYTES`, raises :class:`~gemini_dcp.errors.UntrustedDataError`.
    A group without a gloo process group to run on (a test's fake) uses ``comm.all_gather_object``.
    A transport failure is ``comm.run``'s (RestartRequiredError naming ``what``).
    """
    if not comm.distributed:
        return [obj]
    if comm.group is None:
        return comm.all_gather_object(obj)
    world = comm.world_size
    frame = frame_bytes(world)
    blob = wire.encode(obj)
    head = frame - _LEN.size
    mine = bytearray(frame)
    _LEN.pack_into(mine, 0, len(blob))
    first = blob[:head]
    mine[_LEN.size : _LEN.size + len(first)] = first
    out = [torch.empty(frame, dtype=torch.uint8) for _ in range(world)]
    comm.run(what, dist.all_gather, out, torch.frombuffer(mine, dtype=torch.uint8), group=comm.group)
    frames = [o.numpy() for o in out]
    lengths = [int(f[: _LEN.size].view("<u8")[0]) for f in frames]
    longest = wire.checked_length(what, lengths, MAX_REPORT_BYTES)  # before anything is allocated for it
    tails: list[Any] = [None] * world
    if longest > head:  # some pickle did not fit: every rank sees it in the same lengths
        rest = longest - head
        tail = bytearray(rest)
        extra = blob[head:]
        tail[: len(extra)] = extra
        more = [torch.empty(rest, dtype=torch.uint8) for _ in range(world)]
        comm.run(what, dist.all_gather, more, torch.frombuffer(tail, dtype=torch.uint8), group=comm.group)
        tails = [m.numpy() for m in more]
    values: list[T] = []
    for f, n, t in zip(frames, lengths, tails):
        data = f[_LEN.size : _LEN.size + min(n, head)].tobytes()
        if n > head:
            data += t[: n - head].tobytes()
        values.append(wire.decode(data, f"{what}: group rank {len(values)}'s report", allowed))
    return values
