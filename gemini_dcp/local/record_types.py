"""Step record types: what a committed step is made of.

A :class:`StepRecord` is written by every node that holds bytes of the step,
only after every rank's shards were written and checksummed (the commit
protocol, :mod:`gemini_dcp.commit.protocol`). Its global part (DCP metadata with one
:class:`ShardRef` per stored item, rank→node map, placement) is identical on all
nodes; ``slots`` is node-specific: which slot file on *this* node holds which
rank's bytes.

The types pickle into a compact form (``__reduce__`` below: the shared metadata shell
and layout once, as cached bytes); :mod:`gemini_dcp.local.record_codec` frames those
pickles as ``GEMREC`` files.
Every class or function named in a pickle here is on the allow-list of
:mod:`gemini_dcp.core.safe_pickle` at this module's path.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from array import array
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Generic, NamedTuple, TypeVar

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..core.safe_pickle import restricted_loads
from ..errors import UntrustedDataError
from .parity_record import ParityLayout

# --- process-global caches (and the per-thread decoding context) behind the types ---
#
# Process-global caches (and the per-thread decoding context) behind the step record types.
#
# A step record holds one entry per chunk of every rank, and the records of one plan share
# their DCP metadata shell, their chunk indexes and their layout step after step. These
# caches let that shared part be pickled, decoded, hashed and indexed once per layout
# instead of once per record. Every cache is
# bounded and keyed by identity or by the exact bytes it was built from; all of them are
# safe to use from several saving threads.
#
# The nine caches: ``_blob_cache`` (the pickled metadata shell, encode), ``_shells`` (decoded
# metadata shells), ``_indexes`` (shared MetadataIndex objects), and per layout object
# ``_positions``, ``_locations``, ``_values``, ``_digests``, ``_layout_blobs`` (encode) and
# ``_layouts_by_blob`` (decode).

# The pickled metadata shells of the last records encoded in this process, with the parts each was
# made of, most recently used first: one tuple, read and replaced in single steps (saving threads
# may encode concurrently). Holding the parts keeps them alive, so their ids cannot be reused while
# an entry stands. Several entries, not one: on rank 0 of a plain dcp.save the protocol digests the
# newly planned metadata, then the record is encoded with the shell every rank already holds (an
# equal, older object); with one entry each would evict the other and cost a full comparison.
_MAX_BLOBS = 4
_blob_cache: tuple[tuple[tuple[object, ...], bytes], ...] = ()


def metadata_shell_blob(meta: Metadata) -> bytes:
    """``meta`` without ``storage_data`` and ``storage_meta``, pickled (cached while its parts are the same objects)."""
    global _blob_cache
    shell = replace(meta, storage_data=None, storage_meta=None)
    parts = tuple(getattr(shell, f) for f in shell.__dataclass_fields__)
    entries = _blob_cache
    for i, (cached_parts, cached_blob) in enumerate(entries):
        if len(parts) == len(cached_parts) and all(a is b for a, b in zip(parts, cached_parts)):
            if i:
                _blob_cache = (entries[i],) + entries[:i] + entries[i + 1 :]
            return cached_blob
    # A plain dcp.save plans new metadata objects every save, usually equal to the last ones:
    # comparing them (~1 us per tensor) is far cheaper than pickling them again.
    if entries and len(parts) == len(entries[0][0]) and _equal_parts(parts, entries[0][0]):
        blob = entries[0][1]
    else:
        blob = pickle.dumps(shell, protocol=pickle.HIGHEST_PROTOCOL)
    _blob_cache = ((parts, blob),) + entries[: _MAX_BLOBS - 1]
    return blob


def _equal_parts(parts: tuple[object, ...], cached: tuple[object, ...]) -> bool:
    """The metadata fields are equal (dataclass equality: what a restore reads of them)."""
    try:
        return all(a is b or (type(a) is type(b) and bool(a == b)) for a, b in zip(parts, cached))
    except Exception:  # noqa: BLE001 - an uncomparable value (a tensor in planner_data): pickle it
        return False


# Decoding, the other way round: the records of one plan carry the same metadata shell and
# the same chunk indexes, step after step; both are immutable once built (DCP and this
# package only read them), so they are decoded once and shared by every record that has them.
_MAX_SHELLS = 8
_MAX_INDEXES = 1 << 16
_shells: dict[bytes, Metadata] = {}
_indexes: dict[tuple[object, ...], MetadataIndex] = {}
_remember_lock = threading.Lock()

K = TypeVar("K")
V = TypeVar("V")


def _remember(cache: dict[K, V], key: K, value: V, bound: int) -> V:
    """Store ``value`` under ``key``, evicting the oldest entries beyond ``bound`` (saving threads decode too)."""
    with _remember_lock:
        while len(cache) >= bound:
            del cache[next(iter(cache))]
        cache[key] = value
    return value


def _index(fqn: str, offset: tuple[int, ...] | None, hint: int | None) -> MetadataIndex:
    """The shared MetadataIndex for these fields (records of one plan share their indexes)."""
    key = (fqn, offset, hint)
    idx = _indexes.get(key)
    if idx is None:
        if len(_indexes) > _MAX_INDEXES:
            _indexes.clear()
        idx = _indexes[key] = MetadataIndex(fqn, offset, hint)
    return idx


def metadata_shell(meta_blob: bytes) -> Metadata:
    """The decoded (restricted-unpickled) DCP metadata shell of ``meta_blob``, shared by every record that has it."""
    shell = _shells.get(meta_blob)
    if shell is None:
        loaded = restricted_loads(meta_blob, source="a step record's DCP metadata", writer_torch=reading_torch())
        if not isinstance(loaded, Metadata):
            raise UntrustedDataError(
                f"a step record's DCP metadata holds a {type(loaded).__name__}, not a Metadata; it was not used. "
                "Remove the record (see docs/security.md)."
            )
        shell = _remember(_shells, meta_blob, loaded, _MAX_SHELLS)
    return shell


class _PerLayout(Generic[V]):
    """A value computed once per layout object, for the last few layouts.

    Keyed by identity, not equality (a layout has one entry per chunk of every rank,
    and every record of a plan shares one). Entries hold their layout, so an id
    cannot be reused while its entry stands; the list is replaced in one step.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: list[tuple[object, V]] = []

    def get(self, layout: object, build: Callable[[], V]) -> V:
        for cached, value in tuple(self._entries):
            if cached is layout:
                return value
        return self.put(layout, build())

    def put(self, layout: object, value: V) -> V:
        self._entries = [(layout, value)] + self._entries[: self._size - 1]
        return value


_MAX_LAYOUTS = 4
_positions: _PerLayout[dict[MetadataIndex, int]] = _PerLayout(_MAX_LAYOUTS)  # index -> position
_locations: _PerLayout[dict[tuple[int, int], int]] = _PerLayout(_MAX_LAYOUTS)  # (rank, offset) -> position
_values: _PerLayout[list[ShardRef]] = _PerLayout(_MAX_LAYOUTS)  # the refs in order
_digests: _PerLayout[tuple[bytes, np.ndarray]] = _PerLayout(_MAX_LAYOUTS)  # fingerprint location part
# The pickled layout (encode): one per layout of the last few, so that several writers in one
# process (a model and an optimizer writer, a benchmark's writers) do not re-pickle theirs in turn.
_layout_blobs: _PerLayout[bytes] = _PerLayout(_MAX_LAYOUTS)
_layouts_by_blob: dict[bytes, PackedLayout] = {}  # decode


# The torch version in the header of the record being decoded on this thread (for messages
# from the nested unpickling of the metadata shell and the layout).
decoding_context = threading.local()


def reading_torch() -> str | None:
    return getattr(decoding_context, "torch_version", None)


class ShardRef(NamedTuple):
    """Where one stored item (tensor chunk or pickled bytes) lives: ``storage_data`` of a WriteResult.

    ``offset``/``length`` are bytes inside the owning rank's slot for the step;
    ``dtype``/``shape`` describe a tensor chunk (None for a bytes item).

    A named tuple, immutable like a frozen dataclass but ~10x cheaper to build: a step
    record holds one per chunk of every rank, and a restoring process decodes them all
    (230 k chunks at 256 ranks x 900 tensors).
    """

    rank: int
    offset: int
    length: int
    checksum: int
    algo: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def astuple(self) -> tuple[object, ...]:
        """The fields in order: ``ShardRef(*ref.astuple()) == ref``."""
        return tuple(self)

    def with_checksum(self, checksum: int) -> ShardRef:
        """The same chunk location with another checksum (a later save of the same plan)."""
        return _new_ref(ShardRef, (self[0], self[1], self[2], checksum, self[4], self[5], self[6]))

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # The fields as a plain tuple, as records written by earlier versions store them.
        return (ShardRef, tuple(self))


_new_ref = tuple.__new__  # builds a ShardRef from a full 7-tuple without the keyword machinery


@dataclass(frozen=True, slots=True)
class RankSlot:
    """Bytes of ``rank`` for a step live in ``slot`` (``nbytes`` used) on the node writing the record."""

    rank: int
    slot: int
    nbytes: int

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (RankSlot, (self.rank, self.slot, self.nbytes))


@dataclass(frozen=True, slots=True)
class StepRecord:
    job_id: str
    step: int
    world_size: int
    metadata: Metadata
    rank_nodes: tuple[str, ...]          # node id of each saving rank
    rank_nbytes: tuple[int, ...]         # bytes each rank stored
    holders: dict[str, tuple[str, ...]]  # origin node id -> node ids holding a copy (incl. itself)
    replicas: int
    placement: str
    slots: tuple[RankSlot, ...] = ()     # node-specific
    node_id: str = ""                    # the node that wrote this record
    created_unix: float = field(default_factory=time.time)
    complete: bool = True                # False: written without the coordinator's final metadata
    launch_id: str = ""                  # the launch that saved it (gemini_dcp.transport.launch.current_launch)
    launch_description: str = ""         # human-readable form of that launch, for messages
    parity: ParityLayout | None = None   # XOR parity of the step (parity_group; gemini_dcp.peer.parity)
    # Incremental saves: (item bytes copied, item bytes carried from the slot) per rank; () = all copied.
    rank_save_bytes: tuple[tuple[int, int], ...] = ()
    # Health (gemini_dcp.health): (rank, fqn, count) of every item holding NaN/Inf values; whether the
    # step is healthy (None: not checked, nonfinite="ignore" or an older record: restorable by default).
    nonfinite: tuple[tuple[int, str, int], ...] = ()
    healthy: bool | None = None
    # The timeline the step was saved on: "" before any in-job rollback, else the rollback's id
    # (LocalTier.note_restore): a step of an abandoned timeline is never restored once one of the new commits.
    timeline: str = ""
    # (node id, failure domain) of every node that named one (GeminiOptions.failure_domain), in node order.
    node_domains: tuple[tuple[str, str], ...] = ()

    def __setstate__(self, state: Sequence[object]) -> None:
        # Records pickled field by field (before __reduce__ existed) hold fewer fields than
        # the class has now: the missing trailing ones take their defaults.
        for f, value in zip(_STEP_FIELDS, state):
            object.__setattr__(self, f.name, value)
        for f in _STEP_FIELDS[len(state):]:
            object.__setattr__(self, f.name, f.default_factory() if f.default is MISSING else f.default)  # type: ignore[misc, operator]

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # The DCP metadata minus its storage_data / storage_meta is the same object on every
        # save that replays a plan (gemini_dcp.snapshot.replay) and by far the largest part of a
        # record (one TensorStorageMetadata per tensor): pickled once, then reused as bytes.
        meta = self.metadata
        return (
            _rebuild_record,
            (
                self.job_id, self.step, self.world_size, metadata_shell_blob(meta), meta.storage_meta,
                _pack_storage_data(meta.storage_data),
                self.rank_nodes, self.rank_nbytes, self.holders, self.replicas, self.placement, self.slots,
                self.node_id, self.created_unix, self.complete, self.launch_id, self.launch_description,
                # trailing optional fields, positional: pickled only up to the last one set (older records decode unchanged)
                *_trailing(self),
            ),
        )

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.rank_nodes))

    def domain_of(self, node_id: str) -> str | None:
        """The failure domain ``node_id`` named when this step was saved (None: none given)."""
        return dict(self.node_domains).get(node_id)

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_nbytes)

    def ranks_of(self, node_id: str) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.rank_nodes) if n == node_id)

    def held_ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.slots)

    def slot_of(self, rank: int) -> RankSlot | None:
        for s in self.slots:
            if s.rank == rank:
                return s
        return None

    def for_node(self, node_id: str, slots: tuple[RankSlot, ...]) -> StepRecord:
        return replace(self, node_id=node_id, slots=slots)

    def fingerprint(self) -> str:
        """Hash of the global (node-independent) part: equal on every node for one save.

        Content only (never pickled bytes, which depend on object sharing): where every
        chunk lives, then the checksums in the same (index-sorted) order. For a replayed
        record the location part is hashed once per layout and the checksums are one
        array permutation, so it costs milliseconds at any size.
        """
        h = hashlib.sha256()
        h.update(f"{self.job_id}|{self.step}|{self.world_size}|{self.rank_nodes}|{self.rank_nbytes}".encode())
        sd = self.metadata.storage_data
        if isinstance(sd, ChecksumOverlay) and not sd.moved:  # (moved values: the places differ, hashed below)
            digest, order = _digests.get(sd.layout, lambda: _location_digest(sd.layout))
            sums = np.frombuffer(sd.checksums, dtype=np.uint64)[order]
        elif isinstance(sd, PackedLayout):  # a decoded record: its rows are immutable, hashed once per layout
            digest, sums = _packed_sums.get(sd, lambda: _packed_fingerprint_parts(sd))
        else:
            digest, order = _location_digest(sd)
            values = list(sd.values())
            sums = np.fromiter((values[i].checksum for i in order), dtype=np.uint64, count=len(order))
        h.update(digest)
        h.update(sums.astype("<u8").tobytes())
        return h.hexdigest()[:16]


_STEP_FIELDS = fields(StepRecord)
_TRAILING = ("parity", "rank_save_bytes", "nonfinite", "healthy", "timeline", "node_domains")
_TRAILING_DEFAULTS = (None, (), (), None, "", ())


def _trailing(rec: StepRecord) -> tuple[object, ...]:
    """The trailing optional fields of ``rec`` up to the last one not at its default."""
    values = tuple(getattr(rec, name) for name in _TRAILING)
    n = len(values)
    while n and values[n - 1] == _TRAILING_DEFAULTS[n - 1] and (values[n - 1] is not False):
        n -= 1
    return values[:n]


_PACKED = "gemini_dcp.shardrefs.v1"
_packed_layouts: dict[tuple[_Row, ...], PackedLayout] = {}  # decoded rows -> their one layout (exact rows)
_packed_sums: _PerLayout[tuple[bytes, np.ndarray]] = _PerLayout(_MAX_LAYOUTS)  # packed layout -> fingerprint rows part


def _pack_storage_data(storage_data: object) -> object:
    """``{MetadataIndex: ShardRef}`` as flat tuples (pickling torch's MetadataIndex field by
    field costs ~3x more); anything else unchanged."""
    if isinstance(storage_data, PackedLayout):
        return (_PACKED, storage_data.rows)
    if not isinstance(storage_data, dict):
        return storage_data
    rows = []
    for k, v in storage_data.items():
        if type(k) is not MetadataIndex or type(v) is not ShardRef:
            return storage_data
        rows.append((k.fqn, None if k.offset is None else tuple(k.offset), k.index, *v))
    return (_PACKED, tuple(rows))


def _unpack_storage_data(packed: object) -> object:
    if not (isinstance(packed, tuple) and len(packed) == 2 and packed[0] == _PACKED):
        return packed
    rows = packed[1]
    # Every record of one save holds the same rows (each node's copy, the copy the restore decision
    # broadcasts, the same record decoded by the next reader): one layout for all of them, so what
    # is derived from the rows (the fingerprint's digest, the lookup indexes) is computed once. The
    # dict compares the rows in full on a hit (exact content, never a hash alone).
    try:
        layout = _packed_layouts.get(rows)  # type: ignore[call-overload]
    except TypeError:  # unhashable rows (not what this package writes): a layout of their own
        return PackedLayout(rows)  # type: ignore[arg-type]
    if layout is None:
        layout = _remember(_packed_layouts, rows, PackedLayout(rows), _MAX_LAYOUTS)  # type: ignore[arg-type]
    return layout



_Row = tuple  # (fqn, offset tuple | None, index hint, *ShardRef fields): one stored chunk


class PackedLayout(Mapping[MetadataIndex, ShardRef]):
    """A decoded ``{MetadataIndex: ShardRef}``, kept as the flat rows it was stored as.

    A record holds one entry per chunk of every rank (230 k at 256 ranks x 900 tensors);
    building a MetadataIndex and a ShardRef for each cost ~2 s per decoded layout, paid
    by every restoring process before it read a byte, though a rank reads only its own
    chunks and those it serves. Here decoding is the unpickling of plain tuples; a lookup
    builds (once per layout) a dict keyed by ``(fqn, offset)`` or ``(rank, slot offset)``
    tuples and materializes only the ShardRefs read. Iterating the keys materializes the
    MetadataIndexes once. It compares equal to the dict of the same items.
    """

    __slots__ = ("_by_index", "_by_location", "_keys", "rows")

    def __init__(self, rows: tuple[_Row, ...]) -> None:
        self.rows = rows
        self._by_index: dict[tuple[str, tuple[int, ...] | None], int] | None = None
        self._by_location: dict[tuple[int, int], int] | None = None
        self._keys: list[MetadataIndex] | None = None

    def position(self, index: MetadataIndex) -> int:
        """The row of ``index``; KeyError if absent (or not an index at all)."""
        pos = self._by_index
        if pos is None:
            pos = self._by_index = {(r[0], r[1]): i for i, r in enumerate(self.rows)}
        offset = getattr(index, "offset", None)
        try:
            return pos[(getattr(index, "fqn", None), None if offset is None else tuple(offset))]  # type: ignore[index]
        except (KeyError, TypeError):
            raise KeyError(index) from None

    def location_positions(self) -> dict[tuple[int, int], int]:
        """``(saving rank, slot offset) -> row``, built once."""
        pos = self._by_location
        if pos is None:
            pos = self._by_location = {(r[3], r[4]): i for i, r in enumerate(self.rows)}
        return pos

    def ref_at(self, i: int) -> ShardRef:
        return _new_ref(ShardRef, self.rows[i][3:])

    def keys_in_order(self) -> list[MetadataIndex]:
        keys = self._keys
        if keys is None:
            keys = self._keys = [_index(r[0], r[1], r[2]) for r in self.rows]
        return keys

    def locations(self) -> Iterator[tuple[str, tuple[int, ...], int, int, int]]:
        """(fqn, chunk offset, rank, slot offset, length) per row: what the fingerprint hashes."""
        return ((r[0], tuple(r[1] or ()), r[3], r[4], r[5]) for r in self.rows)

    def __getitem__(self, index: MetadataIndex) -> ShardRef:
        return self.ref_at(self.position(index))

    def __contains__(self, index: object) -> bool:
        try:
            self.position(index)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self.keys_in_order())

    def __len__(self) -> int:
        return len(self.rows)

    def values(self) -> ValuesView[ShardRef]:
        return _PackedValues(self)

    def items(self) -> ItemsView[MetadataIndex, ShardRef]:
        return _PackedItems(self)

    def __repr__(self) -> str:
        return f"PackedLayout({len(self)} chunks)"

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (PackedLayout, (self.rows,))


class _PackedValues(ValuesView[ShardRef]):
    _mapping: PackedLayout

    def __iter__(self) -> Iterator[ShardRef]:
        return (_new_ref(ShardRef, r[3:]) for r in self._mapping.rows)


class _PackedItems(ItemsView[MetadataIndex, ShardRef]):
    _mapping: PackedLayout

    def __iter__(self) -> Iterator[tuple[MetadataIndex, ShardRef]]:
        m = self._mapping
        return zip(m.keys_in_order(), (_new_ref(ShardRef, r[3:]) for r in m.rows))



class ChecksumOverlay(Mapping[MetadataIndex, ShardRef]):
    """``storage_data`` of a save whose chunks all land where an earlier save put them (a
    replayed plan, or a plain ``dcp.save`` of an unchanged structure): that layout, with
    this save's checksums.

    Only the checksums are new. Holding them as one array beside the shared layout
    keeps a step's commit O(1) in Python objects — materializing a ShardRef (and a
    WriteResult) per chunk of every rank cost ~0.9 s per save on every rank at 64
    ranks × 900 tensors — and pickles as the layout's cached blob plus the array.
    Reads (restore, inspect) materialize ShardRefs on access; it compares equal to
    the plain dict of the same items.

    ``checksums`` follow the layout's iteration order. ``moved``: the pickled values of this
    save whose bytes changed length (or place) in their slot, ``{position: (offset, length)}``
    in the same order — a value that grows or shrinks every step (a dataloader's buffer) keeps
    the save compact instead of rebuilding every chunk's ShardRef.
    """

    __slots__ = ("checksums", "layout", "moved")

    def __init__(self, layout: Mapping[MetadataIndex, ShardRef], checksums: Sequence[int] | array,
                 moved: Mapping[int, tuple[int, int]] | None = None) -> None:
        sums = checksums if isinstance(checksums, array) and checksums.typecode == "Q" else array("Q", checksums)
        if len(sums) != len(layout):
            raise ValueError(f"ChecksumOverlay: {len(sums)} checksums for a layout of {len(layout)} chunks")
        self.layout = layout
        self.checksums = sums
        self.moved: dict[int, tuple[int, int]] = {}
        for i, (offset, length) in (moved or {}).items():
            if type(i) is not int or type(offset) is not int or type(length) is not int or not (
                0 <= i < len(sums) and offset >= 0 and length >= 0
            ):
                raise ValueError(f"ChecksumOverlay: moved chunk {i!r} -> ({offset!r}, {length!r}) is not a position "
                                 f"in 0..{len(sums) - 1} with a place (offset, length) >= 0")
            self.moved[i] = (offset, length)

    def __getitem__(self, index: MetadataIndex) -> ShardRef:
        layout = self.layout
        if isinstance(layout, PackedLayout):
            i = layout.position(index)
            ref = layout.ref_at(i).with_checksum(self.checksums[i])
        else:
            positions = _positions.get(layout, lambda: {idx: i for i, idx in enumerate(layout)})
            i = positions[index]
            ref = layout[index].with_checksum(self.checksums[i])
        return self.placed(i, ref)

    def placed(self, i: int, ref: ShardRef) -> ShardRef:
        """``ref`` (the chunk at position ``i``) where this save put it: moved, or as the layout has it."""
        hit = self.moved.get(i) if self.moved else None
        return ref if hit is None else ref._replace(offset=hit[0], length=hit[1])

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, index: object) -> bool:
        return index in self.layout

    def __repr__(self) -> str:
        return f"ChecksumOverlay({len(self)} chunks)"

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        if self.moved:  # (records without moved values decode as before, with older versions too)
            return (_rebuild_overlay, (_layout_blob(self.layout), self.checksums, tuple(sorted(self.moved.items()))))
        return (_rebuild_overlay, (_layout_blob(self.layout), self.checksums))


class _RefsByLocation(Mapping[tuple[int, int], ShardRef]):
    """``(saving rank, slot offset) -> ShardRef`` over a packed layout (with an overlay's
    checksums, if any) or an overlay of a dict layout, materializing only what is read."""

    __slots__ = ("ref_at", "row_of")

    def __init__(self, storage_data: PackedLayout | ChecksumOverlay) -> None:
        layout = storage_data.layout if isinstance(storage_data, ChecksumOverlay) else storage_data
        sums = storage_data.checksums if isinstance(storage_data, ChecksumOverlay) else None
        if isinstance(layout, PackedLayout):
            self.row_of = layout.location_positions()
            self.ref_at: Callable[[int], ShardRef] = (
                layout.ref_at if sums is None else (lambda i: layout.ref_at(i).with_checksum(sums[i]))
            )
        else:  # an overlay of a dict layout (the writer's own process)
            assert isinstance(storage_data, ChecksumOverlay)
            refs = _values.get(layout, lambda: list(layout.values()))
            self.row_of = _locations.get(layout, lambda: {(ref.rank, ref.offset): i for i, ref in enumerate(refs)})
            self.ref_at = lambda i: refs[i].with_checksum(sums[i])  # type: ignore[index]
        if isinstance(storage_data, ChecksumOverlay) and storage_data.moved:
            # a few pickled values elsewhere in their slot: the shared maps stay as they are
            base_ref_at, row_of, placed = self.ref_at, dict(self.row_of), storage_data.placed
            olds = {i: base_ref_at(i) for i in storage_data.moved}
            for i, old in olds.items():
                if row_of.get((old.rank, old.offset)) == i:
                    del row_of[(old.rank, old.offset)]
            for i, old in olds.items():
                row_of[(old.rank, placed(i, old).offset)] = i
            self.row_of, self.ref_at = row_of, lambda i: placed(i, base_ref_at(i))

    def __getitem__(self, key: tuple[int, int]) -> ShardRef:
        return self.ref_at(self.row_of[key])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.row_of)

    def __len__(self) -> int:
        return len(self.row_of)


def refs_by_location(storage_data: Mapping[MetadataIndex, ShardRef]) -> Mapping[tuple[int, int], ShardRef]:
    """Every stored chunk by ``(saving rank, offset in its slot)``.

    A restore reads only the chunks its rank needs or serves; for a decoded or replayed
    record the map is a view (the location index is built once per layout) instead of one
    ShardRef per chunk of every rank (~1.5 s on every rank at 256 ranks x 900 tensors).
    """
    if isinstance(storage_data, (ChecksumOverlay, PackedLayout)):
        return _RefsByLocation(storage_data)
    return {(ref.rank, ref.offset): ref for ref in storage_data.values()}


def _location_digest(storage_data: Mapping[MetadataIndex, ShardRef]) -> tuple[bytes, np.ndarray]:
    """(sha256 of every chunk's index and location in index order, that order as positions)."""
    if isinstance(storage_data, PackedLayout):
        rows = list(storage_data.locations())
    else:
        rows = [(k.fqn, tuple(k.offset or ()), v.rank, v.offset, v.length) for k, v in storage_data.items()]
    # (fqn, chunk offset) is unique per chunk, so whole-row order is index order (compared in C).
    order = sorted(range(len(rows)), key=rows.__getitem__)
    h = hashlib.sha256(b"gemini_dcp.locations.v2")
    # repr, not marshal or pickle: their bytes depend on object sharing and interning.
    h.update(repr([rows[i] for i in order]).encode())
    return h.digest(), np.asarray(order, dtype=np.int64)


def _packed_fingerprint_parts(layout: PackedLayout) -> tuple[bytes, np.ndarray]:
    """(location digest, the checksums in its order) of a packed layout: the row part of the fingerprint."""
    digest, order = _digests.get(layout, lambda: _location_digest(layout))
    rows = layout.rows
    sums = np.fromiter((rows[i][6] for i in order), dtype=np.uint64, count=len(order))  # row[6]: ShardRef.checksum
    sums.flags.writeable = False  # shared by every record of this layout
    return digest, sums


def _layout_blob(layout: Mapping[MetadataIndex, ShardRef]) -> bytes:
    def build() -> bytes:
        # The location digest and order of the fingerprint ride along (computed once per layout
        # here), so a restoring rank does not sort and hash every chunk of every rank again.
        digest, order = _digests.get(layout, lambda: _location_digest(layout))
        rows = layout if isinstance(layout, (dict, PackedLayout)) else dict(layout)  # no copy of a dict
        packed = (_pack_storage_data(rows), digest, order.astype("<i8").tobytes())
        return pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)

    return _layout_blobs.get(layout, build)


def _rebuild_overlay(blob: bytes, checksums: array, moved: tuple[tuple[int, tuple[int, int]], ...] = ()) -> ChecksumOverlay:
    layout = _layouts_by_blob.get(blob)
    if layout is None:
        loaded = restricted_loads(blob, source="a step record's chunk layout", writer_torch=reading_torch())
        digest: bytes | None = None
        if isinstance(loaded, tuple) and len(loaded) == 3 and loaded[0] != _PACKED:  # (layout, digest, order)
            loaded, digest, order_bytes = loaded
        layout = _remember(_layouts_by_blob, blob, _unpack_storage_data(loaded), _MAX_LAYOUTS)  # type: ignore[arg-type, misc]
        if digest is not None and isinstance(layout, (dict, PackedLayout)):
            order = np.frombuffer(order_bytes, dtype="<i8").astype(np.int64)
            if len(order) == len(layout):
                _digests.put(layout, (digest, order))
    if not isinstance(moved, tuple) or not all(isinstance(m, tuple) and len(m) == 2 and isinstance(m[1], tuple)
                                               and len(m[1]) == 2 for m in moved):
        raise ValueError("a step record's chunk overlay names its moved values in another shape: not a gemini_dcp record")
    return ChecksumOverlay(layout, checksums, dict(moved))  # type: ignore[arg-type]


def _rebuild_record(
    job_id: str, step: int, world_size: int, meta_blob: bytes, storage_meta: object, storage_data: object,
    *rest: object,
) -> StepRecord:
    meta = replace(metadata_shell(meta_blob), storage_data=_unpack_storage_data(storage_data), storage_meta=storage_meta)  # type: ignore[arg-type]
    return StepRecord(job_id, step, world_size, meta, *rest)  # type: ignore[arg-type]

