"""The chunk sink: where a chunk read from any tier is verified and landed in its destination.

Every read path (the local tier, peer receives and repair rounds, the persistent store, the
operator commands) verifies a chunk against the checksum its record names before a byte of
it reaches a caller's tensor, and reports a corrupt chunk with the one message built here
(:func:`corrupt_message`).

From the bottom up:

* :func:`chunk_matches` / :func:`verify_chunk` — whether a chunk's bytes match its checksum
  (no exception: the caller decides whether another copy can be tried).
* :func:`check_chunk` — the same check, raising the one corrupt-chunk error.
* :func:`copy_verified` — copy bytes that may change under the reader (a live slot) into a
  private buffer, hashing exactly the bytes copied; the buffer is returned only if they match.
* :func:`stored_view` — verified bytes viewed as the tensor that was saved (dtype and shape).
* :func:`land` — one verified chunk into its destinations: ``dest.copy_(stored)`` (the value
  conversion stock DCP does for another dtype), or ``planner.load_bytes`` for a bytes item.
* :class:`StagedChunks` — verified chunks held outside the state dict and landed together,
  so a load that fails before :meth:`StagedChunks.land_all` lands nothing.
* :func:`failed_spans` / :func:`land_same_dtype` — the batched form for many small chunks of one
  buffer (``gemini_dcp.dcp.fast_load``): one checksum call per chunk over a memoryview, then one
  ``torch._foreach_copy_`` for all of them.

A chunk's bytes are a flat uint8 CPU tensor (a slot view, a receive buffer), ``bytes``, or a
tensor as read back (its own bytes are hashed).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import ChecksumMismatchError, IncompatibleCheckpointError
from .checksum import as_bytes, buffer_checksum, checksum, copy_and_checksum

__all__ = [
    "ChunkRef",
    "ChunkBytes",
    "Staged",
    "StagedChunks",
    "check_chunk",
    "chunk_matches",
    "copy_verified",
    "corrupt_error",
    "corrupt_message",
    "describe_item",
    "failed_spans",
    "land",
    "land_same_dtype",
    "stored_view",
    "verify_chunk",
]


class ChunkRef(Protocol):
    """What the sink reads of a chunk's reference (:class:`gemini_dcp.local.record_types.ShardRef` has it):
    a structural type, so the sink sits below the tiers that define their records."""

    @property
    def rank(self) -> int: ...

    @property
    def algo(self) -> str: ...

    @property
    def checksum(self) -> int: ...


ChunkBytes = torch.Tensor | bytes | bytearray | memoryview
"""The stored bytes of one chunk: a flat uint8 tensor, a buffer, or a tensor whose bytes count."""


# ---- naming a chunk and the one message -----------------------------------------------------------
def describe_item(item: ReadItem, ref: ChunkRef, step: int) -> str:
    """``shard 'fqn' (offset (..)) of step N, saved by rank R``: how messages name a chunk."""
    idx = item.storage_index
    return f"shard {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}, saved by rank {ref.rank}"


def corrupt_message(what: str, algo: str, sources: str) -> str:
    """The one message for a chunk whose bytes fail their checksum.

    ``what`` names the chunk (:func:`describe_item`, or a tier's own name for an item);
    ``sources`` names the copies tried (a slot file, a peer rank, a store path).
    """
    return (
        f"{what} failed its {algo} checksum in every copy tried ({sources}): the stored bytes differ "
        "from those saved (corrupted in memory or in the store). Nothing was copied from it (into a state "
        "dict, a store or an export). Load an older step (checkpoint_id=...) or a copy in another tier."
    )


def corrupt_error(item: ReadItem, ref: ChunkRef, step: int, sources: str) -> ChecksumMismatchError:
    """The error for a chunk that failed its checksum in every copy tried (``sources`` names them)."""
    return ChecksumMismatchError(corrupt_message(describe_item(item, ref, step), ref.algo, sources))


# ---- verifying ----------------------------------------------------------------------------------
def _flat_bytes(data: ChunkBytes) -> torch.Tensor:
    """``data``'s bytes as a flat uint8 CPU tensor (no copy where the memory allows it)."""
    if isinstance(data, torch.Tensor):
        if data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous():
            return data
        flat = as_bytes(data.contiguous())
        if flat is None:
            raise IncompatibleCheckpointError(
                f"a {data.layout} {data.dtype} tensor on {data.device} has no plain bytes to checksum; "
                "gemini_dcp stores dense CPU tensors only. Load another step."
            )
        return flat
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
        return torch.frombuffer(data, dtype=torch.uint8)


def chunk_matches(data: ChunkBytes, algo: str, expected: int) -> bool:
    """Whether the ``algo`` checksum of ``data``'s bytes is ``expected``."""
    return checksum(_flat_bytes(data), algo) == expected


def verify_chunk(data: ChunkBytes, ref: ChunkRef) -> bool:
    """Whether ``data`` (the stored bytes of the chunk ``ref`` names) match ``ref``'s checksum.

    The check the peer tier runs on a replica it received and on a chunk a repair round
    fetched; nothing is raised, so the caller can try another copy.
    """
    return checksum(_flat_bytes(data), ref.algo) == ref.checksum


def check_chunk(
    data: ChunkBytes,
    algo: str,
    expected: int,
    *,
    what: str,
    sources: str,
    error: type[ChecksumMismatchError] = ChecksumMismatchError,
) -> None:
    """Raise ``error`` with :func:`corrupt_message` unless ``data`` matches its checksum.

    ``error`` lets a tier raise its own subclass (the persistent tier's is also a
    ``PersistentTierError``); the message is the same.
    """
    if not chunk_matches(data, algo, expected):
        raise error(corrupt_message(what, algo, sources))


def copy_verified(
    src: torch.Tensor,
    algo: str,
    expected: int,
    *,
    what: str,
    sources: str,
    error: type[ChecksumMismatchError] = ChecksumMismatchError,
) -> torch.Tensor:
    """A private copy of ``src`` (flat uint8) whose bytes match ``expected``; else ``error``.

    For bytes that may change while they are read (a slot a newer save may reuse): the bytes
    hashed are exactly the bytes copied, so a concurrent rewrite fails here, never silently.
    """
    out = torch.empty(src.numel(), dtype=torch.uint8)
    got = copy_and_checksum(out, src, algo) if src.numel() else checksum(out, algo)
    if got != expected:
        raise error(corrupt_message(what, algo, sources))
    return out


# ---- landing ------------------------------------------------------------------------------------
def stored_view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """Verified flat bytes viewed as the chunk that was saved (``dtype``, ``shape``).

    Zero copy where the bytes are aligned for ``dtype`` (a slot, a receive buffer); one copy
    otherwise. IncompatibleCheckpointError when the byte count does not fit ``dtype``/``shape``.
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != buf.numel():
        raise IncompatibleCheckpointError(
            f"{what}: {buf.numel()} stored bytes do not hold a {dtype} chunk of shape {shape}; "
            "the record is inconsistent. Load another step."
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        return buf.view(dtype).view(shape)
    except RuntimeError:  # bytes not aligned for the dtype (never in a slot or a receive buffer)
        return buf.clone().view(dtype).view(shape)


def land(
    items: list[ReadItem],
    stored: torch.Tensor | bytes,
    planner: LoadPlanner,
    dests: dict[int, torch.Tensor] | None = None,
    copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Copy one verified chunk into the destinations of ``items`` (the read items it serves).

    ``stored`` is the chunk as saved (its own dtype and shape), or the raw bytes of a bytes
    item (handed to ``planner.load_bytes``, never reinterpreted). Each tensor item's slice of
    it is copied with ``dest.copy_``: a memcpy for the same dtype, converted values for
    another, as stock DCP converts them. ``dests`` maps ``id(item)`` to a destination resolved
    beforehand (used once, then dropped); otherwise the planner resolves it here. A
    destination of another shape is refused (IncompatibleCheckpointError) before anything
    is copied into it. ``copy(dest, src)`` replaces ``dest.copy_(src)`` (the restore's CUDA
    landing: :class:`gemini_dcp.restore.device_land.DeviceLander`).
    """
    for item in items:
        if item.type == LoadItemType.BYTE_IO:
            raw = stored if isinstance(stored, (bytes, bytearray)) else stored.numpy().tobytes()
            planner.load_bytes(item, io.BytesIO(raw))
            continue
        assert isinstance(stored, torch.Tensor)
        src = stored
        for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            src = src.narrow(dim, off, length)
        dest = dests.pop(id(item), None) if dests is not None else None
        if dest is None:
            dest = planner.resolve_tensor(item).detach()
        if dest.size() != src.size():
            raise IncompatibleCheckpointError(
                f"{item.dest_index.fqn!r}: the stored chunk {tuple(src.size())} does not fit its destination "
                f"{tuple(dest.size())}; nothing of it was copied. Load with the model that saved this step."
            )
        if copy is None:
            dest.copy_(src)  # same dtype: a memcpy; another dtype: converted values, as stock DCP
        else:
            copy(dest, src)
        planner.commit_tensor(item, dest)


class Staged(NamedTuple):
    """One verified chunk waiting, outside the state dict, to be landed.

    ``stored`` is the chunk as saved (its own dtype and shape): a view of verified bytes
    (an mmap'd slot, a receive buffer) or the tensor read from the persistent tier; for a
    bytes item, the raw bytes (a uint8 tensor or ``bytes``).
    """

    items: list[ReadItem]
    stored: torch.Tensor | bytes


class StagedChunks:
    """Verified chunks held outside the state dict until the caller lands them all.

    Only verified chunks may be added; nothing reaches a destination before
    :meth:`land_all`, so a load abandoned before it leaves the caller's tensors as they were.
    """

    __slots__ = ("_chunks",)

    def __init__(self) -> None:
        self._chunks: list[Staged] = []

    def add(self, items: list[ReadItem], stored: torch.Tensor | bytes) -> None:
        """Hold one verified chunk (see :class:`Staged`) for :meth:`land_all`."""
        self._chunks.append(Staged(items, stored))

    def extend(self, other: StagedChunks) -> None:
        """Take over every chunk ``other`` holds (``other`` is left empty)."""
        self._chunks.extend(other._chunks)
        other._chunks = []

    def __len__(self) -> int:
        return len(self._chunks)

    def __iter__(self) -> Iterator[Staged]:
        return iter(self._chunks)

    def clear(self) -> None:
        """Drop every held chunk (and with it any view of tier memory)."""
        self._chunks.clear()

    def land_all(
        self,
        planner: LoadPlanner,
        dests: dict[int, torch.Tensor] | None = None,
        after_first: Callable[[], None] | None = None,
        copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Land every held chunk (:func:`land`, with ``copy``), then hold nothing.

        ``after_first`` runs once the first chunk has landed (a fault-injection point).
        """
        chunks, self._chunks = self._chunks, []
        try:
            for n, entry in enumerate(chunks):
                land(entry.items, entry.stored, planner, dests, copy)
                if n == 0 and after_first is not None:
                    after_first()
        finally:
            chunks.clear()


# ---- batched: many chunks of one buffer ------------------------------------------------------------
def failed_spans(buf: memoryview, spans: Sequence[tuple[int, int, str, int]]) -> list[int]:
    """The positions in ``spans`` (``(offset, length, algo, checksum)`` into ``buf``) whose bytes fail
    their checksum; empty when all match. One checksum call per span, no tensor built."""
    bad: list[int] = []
    fns: dict[str, Callable[[memoryview], int]] = {}
    for i, (off, length, algo, expected) in enumerate(spans):
        fn = fns.get(algo)
        if fn is None:
            fn = fns[algo] = buffer_checksum(algo)
        if fn(buf[off : off + length]) != expected:
            bad.append(i)
    return bad


def land_same_dtype(dests: Sequence[torch.Tensor], stored: Sequence[torch.Tensor]) -> None:
    """Copy verified chunks into their destinations in one call (``torch._foreach_copy_``).

    ``stored[i]`` must hold exactly ``dests[i]``'s bytes (same dtype and shape, or both flat uint8
    views of them): the caller checked the structure; only verified bytes may be passed.
    """
    if len(dests) != len(stored):
        raise ValueError(f"{len(dests)} destinations for {len(stored)} chunks")
    if dests:
        torch._foreach_copy_(list(dests), list(stored))
