"""The typed, versioned JSON records the trainer and the drain server exchange through the node's tmpfs.

- :class:`DrainRequest` (``requests/step-N.json``): one step to upload, written by the node
  leader after the commit (or by an adopting node after a restore).
- :class:`DrainConfig` (``config.json``): the store, cadence and :class:`DrainOptions` a writer
  with a persistent tier left on the node, for the adoption of a lost node's part.
- :class:`Progress` (``stage/step-N/progress.json``): what an upload of a step has done, so a
  killed server resumes where it stopped.

Every record is a frozen dataclass with ``to_json`` / ``from_json`` and a ``version``. A record
of a newer (or unknown) version, or one that is not a record at all, is refused with
:class:`~gemini_dcp.errors.IncompatibleCheckpointError` saying what to do; the previous
release's ad-hoc JSON (version 1 requests and configs) is read as well. Nothing is
unpickled here; the previous release's pickled ``progress.pkl`` is read (restricted, never
running code) by :func:`gemini_dcp.persistent.drain.upload.load_legacy_progress`. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ...errors import ConfigError, IncompatibleCheckpointError
from ...options.persistent import DrainOptions

__all__ = [
    "CONFIG_VERSION", "PROGRESS_VERSION", "REQUEST_VERSION", "DrainConfig", "DrainRequest", "FileResult",
    "Progress", "SlotRef", "StoreTarget", "StoredItem",
]

REQUEST_VERSION = 2  # 1: the previous release's flat JSON (read as well)
CONFIG_VERSION = 2  # 1: the previous release's flat JSON (read as well)
PROGRESS_VERSION = 1  # the previous release pickled its progress (progress.pkl)

R = TypeVar("R")


def _load(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise IncompatibleCheckpointError(f"{what} is not valid JSON ({exc}): it was not written by gemini_dcp.") from None
    if not isinstance(data, dict):
        raise IncompatibleCheckpointError(
            f"{what} holds a {type(data).__name__}, not a record: it was not written by gemini_dcp."
        )
    return data


def _version(data: Mapping[str, Any], what: str, newest: int, oldest: int = 1) -> int:
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not oldest <= version <= newest:
        raise IncompatibleCheckpointError(
            f"{what} has version {version!r}; this gemini_dcp reads versions {oldest}..{newest}. It was written by "
            "another gemini_dcp release: run the same release on every process of the job (trainers and drains)."
        )
    return version


def _field(data: Mapping[str, Any], key: str, kind: type[R] | tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise IncompatibleCheckpointError(f"{what}: field {key!r} is {value!r}, not a {getattr(kind, '__name__', kind)}.")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotRef:
    """``nbytes`` of rank ``rank``'s slot file ``path`` (JSON: ``[rank, path, nbytes]``)."""

    rank: int
    path: str
    nbytes: int

    def to_list(self) -> list[Any]:
        return [self.rank, self.path, self.nbytes]

    @classmethod
    def from_list(cls, item: Any, what: str) -> "SlotRef":
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise IncompatibleCheckpointError(f"{what}: slot {item!r} is not [rank, path, nbytes].")
        rank, path, nbytes = item
        if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(path, str) or not isinstance(nbytes, int):
            raise IncompatibleCheckpointError(f"{what}: slot {item!r} is not [rank, path, nbytes].")
        return cls(rank=rank, path=path, nbytes=nbytes)


def _slots(items: Any, what: str) -> tuple[SlotRef, ...]:
    if not isinstance(items, list):
        raise IncompatibleCheckpointError(f"{what}: slots {items!r} are not a list.")
    return tuple(SlotRef.from_list(s, what) for s in items)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreTarget:
    """Where a drain uploads to: the store, the job, its retention and the deadline of each store call."""

    url: str
    job_id: str
    keep: int | None = 2
    keep_every: int | None = None
    timeout_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "job_id": self.job_id, "keep": self.keep, "keep_every": self.keep_every,
                "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], what: str) -> "StoreTarget":
        return cls(
            url=_field(data, "url", str, what), job_id=_field(data, "job_id", str, what),
            keep=data.get("keep"), keep_every=data.get("keep_every"), timeout_s=data.get("timeout_s"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainRequest:
    """One step a node uploads: its saving ranks' slots, the record to check them against, the store.

    ``rank0_node``: this node holds saving rank 0 and waits for the other nodes' parts to
    commit the step. ``adopted_from``: the lost nodes whose ranks this node uploads.
    ``holds``: the slot hold files (:mod:`gemini_dcp.local.slot_holds`) that keep the writer
    off ``slots`` while the drain reads them in place; none: the server stages a copy first.
    """

    step: int
    root: str
    record_path: str
    node_id: str
    fingerprint: str
    slots: tuple[SlotRef, ...]
    store: StoreTarget
    rank0_node: bool = False
    adopted_from: tuple[str, ...] = ()
    created_unix: float = 0.0
    holds: tuple[str, ...] = ()
    version: int = REQUEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REQUEST_VERSION, "step": self.step, "root": self.root, "record_path": self.record_path,
            "node_id": self.node_id, "fingerprint": self.fingerprint, "slots": [s.to_list() for s in self.slots],
            "store": self.store.to_dict(), "rank0_node": self.rank0_node, "adopted_from": list(self.adopted_from),
            "created_unix": self.created_unix, "holds": list(self.holds),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "a drain request") -> "DrainRequest":
        data = _load(text, source)
        version = _version(data, source, REQUEST_VERSION)
        store = data if version == 1 else _field(data, "store", dict, source)  # version 1 kept the store flat
        adopted = data.get("adopted_from") or ()
        if not isinstance(adopted, (list, tuple)) or not all(isinstance(n, str) for n in adopted):
            raise IncompatibleCheckpointError(f"{source}: adopted_from {adopted!r} is not a list of node ids.")
        holds = data.get("holds") or ()
        if not isinstance(holds, (list, tuple)) or not all(isinstance(h, str) for h in holds):
            raise IncompatibleCheckpointError(f"{source}: holds {holds!r} is not a list of paths.")
        return cls(
            step=_field(data, "step", int, source), root=_field(data, "root", str, source),
            record_path=_field(data, "record_path", str, source), node_id=_field(data, "node_id", str, source),
            fingerprint=_field(data, "fingerprint", str, source), slots=_slots(data.get("slots"), source),
            store=StoreTarget.from_dict(store, source), rank0_node=bool(data.get("rank0_node")),
            adopted_from=tuple(adopted), created_unix=float(data.get("created_unix") or 0.0), holds=tuple(holds),
            version=version,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainConfig:
    """The drain settings a writer with a persistent tier left on its node (``config.json``)."""

    store: StoreTarget
    every: int
    mode: str  # "process" or "thread": how the writer ran its drain
    protocol: str  # the store's fsspec protocol ("memory" stores die with their process)
    drain: DrainOptions = field(default_factory=DrainOptions)
    version: int = CONFIG_VERSION

    def to_json(self) -> str:
        data = {"version": CONFIG_VERSION, "store": self.store.to_dict(), "every": self.every, "mode": self.mode,
                "protocol": self.protocol, "drain": self.drain.to_dict()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "a drain config") -> "DrainConfig":
        data = _load(text, source)
        version = _version(data, source, CONFIG_VERSION)
        every = _field(data, "every", int, source)
        if every < 1:
            raise IncompatibleCheckpointError(f"{source}: every={every!r} is not a drain cadence >= 1.")
        store = data if version == 1 else _field(data, "store", dict, source)
        try:
            drain = DrainOptions.from_dict(data["drain"]) if version >= 2 else DrainOptions()
        except (ConfigError, KeyError, TypeError) as exc:
            raise IncompatibleCheckpointError(f"{source}: its drain options cannot be read ({exc}).") from None
        return cls(store=StoreTarget.from_dict(store, source), every=every, mode=str(data.get("mode") or "process"),
                   protocol=str(data.get("protocol") or ""), drain=drain, version=version)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredItem:
    """Where one item of a data file landed (a DCP ``MetadataIndex`` -> ``_StorageInfo``) and its checksum."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None
    storage: Mapping[str, Any]  # the fields of torch's _StorageInfo (relative_path, offset, length, ...)
    algo: str | None = None
    checksum: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "offset": None if self.offset is None else list(self.offset), "index": self.index,
                "storage": dict(self.storage), "algo": self.algo, "checksum": self.checksum}

    @classmethod
    def from_dict(cls, data: Any, what: str) -> "StoredItem":
        if not isinstance(data, dict) or not isinstance(data.get("fqn"), str) or not isinstance(data.get("storage"), dict):
            raise IncompatibleCheckpointError(f"{what}: item {data!r} is not a stored item.")
        offset = data.get("offset")
        return cls(fqn=data["fqn"], offset=None if offset is None else tuple(int(x) for x in offset),
                   index=data.get("index"), storage=data["storage"], algo=data.get("algo"), checksum=data.get("checksum"))


@dataclass(frozen=True, slots=True, kw_only=True)
class FileResult:
    """One data file in the store: its items and the bytes written."""

    items: tuple[StoredItem, ...]
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """The upload of one staged step so far.

    ``begun``: the step directory was opened in the store (the first upload decision is made).
    ``threads``: the file split, fixed at the start so a resume writes the same files.
    ``slots``: for an adoption, the ranks still to upload, fixed at the start.
    ``files``: the data files already in the store. ``marker``: the part marker is written.
    """

    begun: bool = False
    threads: int | None = None
    slots: tuple[SlotRef, ...] | None = None
    files: Mapping[str, FileResult] = field(default_factory=dict)
    marker: bool = False
    version: int = PROGRESS_VERSION

    def with_file(self, rel: str, result: FileResult) -> "Progress":
        return replace(self, files={**self.files, rel: result})

    def to_json(self) -> str:
        return json.dumps({
            "version": PROGRESS_VERSION, "begun": self.begun, "threads": self.threads,
            "slots": None if self.slots is None else [s.to_list() for s in self.slots],
            "files": {rel: {"items": [it.to_dict() for it in fr.items], "nbytes": fr.nbytes} for rel, fr in self.files.items()},
            "marker": self.marker,
        })

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "a drain progress record") -> "Progress":
        data = _load(text, source)
        _version(data, source, PROGRESS_VERSION)
        files = data.get("files") or {}
        if not isinstance(files, dict):
            raise IncompatibleCheckpointError(f"{source}: files {files!r} are not a mapping.")
        out: dict[str, FileResult] = {}
        for rel, fr in files.items():
            if not isinstance(fr, dict) or not isinstance(fr.get("items"), list):
                raise IncompatibleCheckpointError(f"{source}: file {rel!r} has no item list.")
            out[rel] = FileResult(items=tuple(StoredItem.from_dict(it, source) for it in fr["items"]),
                                  nbytes=int(fr.get("nbytes") or 0))
        slots = data.get("slots")
        threads = data.get("threads")
        return cls(begun=bool(data.get("begun")), threads=None if threads is None else int(threads),
                   slots=None if slots is None else _slots(slots, source), files=out, marker=bool(data.get("marker")))


def slot_lists(slots: Sequence[SlotRef]) -> list[list[Any]]:
    """``[[rank, path, nbytes], ...]``: the slots as the previous release's functions took them."""
    return [s.to_list() for s in slots]
