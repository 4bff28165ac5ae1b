"""Restricted unpickling: bytes read back from a tier never run as code.

Step records, the persistent store's side files (``.gemini/index.pkl``,
``part-*.pkl``) and the drain's ``progress.pkl`` are pickles. A plain
``pickle.loads`` of such a file runs whatever callable the file names, so anyone
who can plant a file in the tier root (another local user, a squatter of
``/dev/shm/gemini_dcp``) could run code as the training process (often root).

:func:`restricted_loads` resolves only the globals listed in
:data:`ALLOWED_GLOBALS` (the classes a gemini_dcp record or DCP ``Metadata`` can
contain), plus torch dtypes, layouts and memory formats, plus what a caller adds
(``allowed=`` or :func:`extend_allowed`). Any other global is refused with
:class:`~gemini_dcp.errors.UntrustedDataError` before it is imported or called.

Keep :data:`ALLOWED_GLOBALS` reviewed: every entry must be a class or function
that, called with attacker-chosen plain arguments, only builds a value (no file,
process, import or attribute access by name). Never add ``builtins``
(``getattr``, ``eval``, ``exec``, ``__import__``), ``os``, ``subprocess``,
``importlib``, ``functools.partial``, ``operator.attrgetter`` or similar.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _dcp_metadata

from ..errors import GeminiError, IncompatibleCheckpointError, UntrustedDataError

_DCP_META = "torch.distributed.checkpoint.metadata"

#: The reviewed allow-list: (module, qualified name) of every global a gemini_dcp record,
#: a DCP ``Metadata`` or a gemini_dcp side file may name. Torch dtypes, layouts and memory
#: formats are allowed by type in :func:`_torch_constant` (new dtypes appear with new torch).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # gemini_dcp step records, at their real module (local/record_types.py)
        ("gemini_dcp.local.record_types", "ShardRef"),
        ("gemini_dcp.local.record_types", "RankSlot"),
        ("gemini_dcp.local.record_types", "StepRecord"),
        ("gemini_dcp.local.record_types", "PackedLayout"),
        ("gemini_dcp.local.record_types", "_rebuild_record"),
        ("gemini_dcp.local.record_types", "_rebuild_overlay"),
        ("gemini_dcp.local.parity_record", "_rebuild_parity"),  # a step's XOR parity layout (peer/parity)
        # DCP metadata (torch.distributed.checkpoint.metadata)
        (_DCP_META, "Metadata"),
        (_DCP_META, "MetadataIndex"),
        (_DCP_META, "TensorStorageMetadata"),
        (_DCP_META, "BytesStorageMetadata"),
        (_DCP_META, "ChunkStorageMetadata"),
        (_DCP_META, "TensorProperties"),
        (_DCP_META, "StorageMeta"),
        (_DCP_META, "_MEM_FORMAT_ENCODING"),
        # torch values inside DCP metadata
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by its name in a cache
        # storage_data of a stock DCP (FileSystemWriter / fsspec) checkpoint's .metadata
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # plain containers
        ("array", "array"),
        ("array", "_array_reconstructor"),
        ("collections", "OrderedDict"),
        ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id may be a path
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),  # Python >= 3.13 pickles paths under pathlib._local
        ("pathlib._local", "PosixPath"),
    }
)

_RECORD_NAMES = ("ShardRef", "RankSlot", "StepRecord", "PackedLayout", "_rebuild_record", "_rebuild_overlay")
_SIDE_FILE_NAMES = ("StepIndex", "PartMarker")

#: Where files written by earlier releases name gemini_dcp's classes, by release:
#: (the module a pickle names, the name) -> the module that holds it now. Only the classes
#: those releases pickled are listed; nothing else of an old module tree is resolved, and what
#: a name maps to must still be on the allow-list of the load.
MODULES_OF_EARLIER_RELEASES: dict[str, dict[tuple[str, str], str]] = {
    # 0.1.0 as a flat package: step records in ``gemini_dcp/records.py``, the persistent
    # store's side files in ``gemini_dcp/persistent.py``
    "0.1.0-flat": {
        **{("gemini_dcp.records", n): "gemini_dcp.local.record_types" for n in _RECORD_NAMES},
        **{("gemini_dcp.persistent", n): "gemini_dcp.persistent.side_files" for n in _SIDE_FILE_NAMES},
    },
    # 0.1.0 in subpackages, before the record types left ``local/records.py`` (side files are
    # still pickled under ``gemini_dcp.persistent.store``, see persistent/side_files.py)
    "0.1.0-subpackages": {("gemini_dcp.local.records", n): "gemini_dcp.local.record_types" for n in _RECORD_NAMES},
}
_MOVED: dict[tuple[str, str], str] = {
    old: new for names in MODULES_OF_EARLIER_RELEASES.values() for old, new in names.items()
}

_extra: set[tuple[str, str]] = set()
_extra_lock = threading.Lock()


def extend_allowed(*names: tuple[str, str]) -> None:
    """Allow more (module, name) globals process-wide (e.g. a caller's own dataclasses).

    Only for plain value classes of gemini_dcp itself; see the module docstring for what
    must never be added.
    """
    for name in names:
        if not (isinstance(name, tuple) and len(name) == 2 and all(isinstance(p, str) for p in name)):
            raise TypeError(f"extend_allowed takes (module, name) string pairs, got {name!r}")
    with _extra_lock:
        _extra.update(names)


def allowed_globals() -> frozenset[tuple[str, str]]:
    """Everything :func:`restricted_loads` resolves by name right now (without ``allowed=``)."""
    with _extra_lock:
        return ALLOWED_GLOBALS | frozenset(_extra)


def _tensor_properties_fields() -> int:
    """How many fields the running torch's ``TensorProperties.__getstate__`` pickles (5 up to torch 2.14)."""
    try:
        return len(_dcp_metadata.TensorProperties().__getstate__())
    except Exception:  # noqa: BLE001 - a torch without __getstate__: the dataclass default
        return 5


_TP_FIELDS = _tensor_properties_fields()


class _TensorPropertiesAnyTorch(_dcp_metadata.TensorProperties):  # type: ignore[misc]
    """Stands in for ``TensorProperties`` while unpickling, accepting both pickled forms.

    torch 2.15 pickles a sixth field (``strides``); torch <= 2.14 unpacks exactly five.
    The state is trimmed (or padded with ``None``) to what the running class takes, then
    the instance becomes a plain ``TensorProperties``.
    """

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            if len(state) > _TP_FIELDS:
                state = state[:_TP_FIELDS]
            elif len(state) < _TP_FIELDS:
                state = state + (None,) * (_TP_FIELDS - len(state))
        _dcp_metadata.TensorProperties.__setstate__(self, state)
        self.__class__ = _dcp_metadata.TensorProperties


_SUBSTITUTES: dict[tuple[str, str], Any] = {(_DCP_META, "TensorProperties"): _TensorPropertiesAnyTorch}

_TORCH_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _torch_constant(module: str, name: str) -> Any | None:
    """A torch dtype / layout / memory format named by a pickle, or None.

    dtypes pickle as ``torch.<name>``; memory formats as ``torch._utils`` +
    ``torch.contiguous_format`` (a dotted name resolved from the torch package).
    These objects are not callable, so resolving them runs nothing.
    """
    if module not in ("torch", "torch._utils"):
        return None
    parts = name.split(".")
    if parts[0] == "torch":
        parts = parts[1:]
    if len(parts) != 1 or parts[0].startswith("_"):
        return None
    value = getattr(torch, parts[0], None)
    return value if isinstance(value, _TORCH_CONSTANT_TYPES) else None


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` resolves only allow-listed globals."""

    def __init__(self, data: bytes, *, source: str, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        module = _MOVED.get((module, name), module)  # a file written by an earlier release
        key = (module, name)
        if key in self._allowed:
            substitute = _SUBSTITUTES.get(key)
            return substitute if substitute is not None else super().find_class(module, name)
        constant = _torch_constant(module, name)
        if constant is not None:
            return constant
        raise UntrustedDataError(
            f"{self._source} names {module}.{name}, which a gemini_dcp file never contains; it was "
            "not loaded (nothing in it ran). Someone or something other than gemini_dcp wrote this "
            "file: check who owns it and the directory it is in, remove it (or the whole job "
            "directory), and keep the tier root private to the user running the job "
            "(see docs/security.md)."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedDataError(
            f"{self._source} holds a persistent reference ({pid!r:.80}), which a gemini_dcp file never "
            "contains; it was not loaded. Remove the file (see docs/security.md)."
        )


def _version_tuple(version: str) -> tuple[int, ...]:
    """``'2.15.0a0+git'`` -> ``(2, 15, 0)``; unparsable parts end the tuple."""
    out: list[int] = []
    for part in version.split("+", 1)[0].split("."):
        digits = ""
        for ch in part:
            if not ("0" <= ch <= "9"):
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def restricted_loads(
    data: bytes,
    *,
    source: str,
    allowed: Collection[tuple[str, str]] | None = None,
    writer_torch: str | None = None,
) -> Any:
    """Unpickle ``data`` resolving only allow-listed globals; never runs other code.

    ``source`` names where the bytes came from (a path, "peer node-3") for messages.
    ``allowed`` adds (module, name) pairs for this call. ``writer_torch`` is the torch
    version that wrote the bytes, when known (a record header carries it).

    Raises :class:`UntrustedDataError` for any global outside the allow-list or for bytes
    that are not a readable pickle, and :class:`IncompatibleCheckpointError` when a
    failure is explained by a newer (or other) torch having written the bytes.
    """
    names = allowed_globals()
    if allowed:
        names = names | frozenset(tuple(a) for a in allowed)  # type: ignore[misc]
    try:
        return _RestrictedUnpickler(bytes(data), source=source, allowed=names).load()
    except GeminiError:  # a refusal, or one from a nested restricted load (a record's metadata)
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle raises almost anything
        running = torch.__version__
        if writer_torch and _version_tuple(writer_torch) != _version_tuple(running):
            raise IncompatibleCheckpointError(
                f"{source} was written by torch {writer_torch} and cannot be read by the running torch "
                f"{running} ({type(exc).__name__}: {exc}). Load it with torch {writer_torch} (or newer), "
                "or save the checkpoint again with this torch."
            ) from exc
        raise UntrustedDataError(
            f"{source} is not a readable gemini_dcp pickle ({type(exc).__name__}: {exc}); it was not "
            "used. It is damaged or was not written by gemini_dcp: remove it (see docs/security.md)."
        ) from exc
