"""DeepSpeed checkpoint files as DCP items, and back: the codec under ``gemini_dcp.integrations.deepspeed``.

One DeepSpeed checkpoint (``engine.save_checkpoint(save_dir, tag)``: every rank's files under
``save_dir/tag/``) is one gemini_dcp step. Each file a rank saves becomes these DCP items (plain
tensors, so every tier, the checksums, the health check and the stock DCP layout of the persistent
tier treat them like any other state)::

    deepspeed/<rank>/<file>/pickle     uint8 tensor: the file's object tree, pickled with every tensor
                                       replaced by a reference (pickle persistent ids "t<i>" / "p<i>")
    deepspeed/<rank>/<file>/<i>        the i-th distinct tensor of that tree (a view is stored as itself)
    deepspeed/tag                      uint8 tensor of TAG_BYTES + 2 bytes: the DeepSpeed tag, its length
                                       first (saved by every rank alike; DCP keeps one copy)

``<rank>`` is the saving rank, so two ranks' files never share a key; ``<file>`` is the path below the
tag directory (``mp_rank_00_model_states.pt``, ``zero_pp_rank_1_mp_rank_00_optim_states.pt``...).
Because the tree is pickled as one value, whatever it holds comes back as it was: an optimizer's
int-keyed ``state`` stays a dict with int keys (DCP's own flattening would turn it into a list), tuples
stay tuples, DeepSpeed's loss scaler objects stay objects. Storage sharing between distinct tensors is
not kept (each is stored as its own item): the engine says so to DeepSpeed
(``preserves_storage_sharing() -> False``).

The tag item has one key and one size whatever the tag, so a job that checkpoints every step saves the
same structure every step (``AsyncCheckpointer`` replays its save plan instead of planning again).

Trust: every byte read back is untrusted. The pickles are DeepSpeed's own content (DeepSpeed reads its
files with ``torch.load(weights_only=False)``); :func:`decode_file` unpickles them with an allowlist of
the modules whose classes DeepSpeed's files hold (``deepspeed``, ``torch``, ``numpy``, ``collections``,
plain builtins...) and raises :class:`~gemini_dcp.errors.UntrustedDataError` for any other global, so a
planted pickle cannot call ``os.system``. A ``client_state`` holding objects of other modules is refused
at load with that error: keep ``client_state`` to plain values and tensors.

:func:`decode_file` rebuilds one file; :func:`deepspeed_files` lists a step's files from its DCP metadata
alone; ``gemini_dcp.persistent.export.export_deepspeed`` writes a step back as DeepSpeed's checkpoint
directory (``latest``, ``<tag>/<files>``) for ``zero_to_fp32.py`` and universal checkpointing.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointMismatchError, ConfigError, UntrustedDataError

PREFIX = "deepspeed"
PICKLE = "pickle"
_FILE_KEY = re.compile(rf"{PREFIX}/([0-9]+)/(.+)/({PICKLE}|[0-9]+)")


TAG_KEY = f"{PREFIX}/tag"
TAG_BYTES = 1024  # the longest tag, in UTF-8 bytes


def tag_item(tag: str) -> dict[str, torch.Tensor]:
    """The item recording ``tag`` (every rank saves the same one; DCP keeps one copy): its UTF-8 length as
    two little-endian bytes, then the bytes, zero-padded to ``TAG_BYTES``."""
    raw = tag.encode()
    if len(raw) > TAG_BYTES:
        raise ConfigError(f"DeepSpeed tag {tag[:40]!r}... is {len(raw)} bytes long; gemini_dcp records tags of at most "
                          f"{TAG_BYTES} bytes: give a shorter tag.")
    buf = bytearray(TAG_BYTES + 2)
    buf[0:2] = len(raw).to_bytes(2, "little")
    buf[2 : 2 + len(raw)] = raw
    return {TAG_KEY: torch.frombuffer(buf, dtype=torch.uint8)}


def is_deepspeed_step(metadata: Metadata) -> bool:
    """Whether a step's metadata is that of a DeepSpeed checkpoint (no data read)."""
    return TAG_KEY in metadata.state_dict_metadata


def tag_template() -> dict[str, torch.Tensor]:
    """An empty tag item to ``dcp.load`` the tag into."""
    return {TAG_KEY: torch.zeros(TAG_BYTES + 2, dtype=torch.uint8)}


def tag_value(item: torch.Tensor) -> str:
    """The tag a loaded tag item holds (it was read back: checked, never trusted)."""
    raw = bytes(item.numpy().tobytes())
    n = int.from_bytes(raw[0:2], "little") if len(raw) == TAG_BYTES + 2 else -1
    if not 0 <= n <= TAG_BYTES:
        raise UntrustedDataError(f"the DeepSpeed tag item holds {len(raw)} bytes with length {n}: not one gemini_dcp wrote.")
    try:
        return raw[2 : 2 + n].decode()
    except UnicodeDecodeError as exc:
        raise UntrustedDataError(f"the DeepSpeed tag item is not UTF-8 ({exc}): not one gemini_dcp wrote.") from None


class _Pickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, str] = {}

    def persistent_id(self, obj: Any) -> str | None:
        if not isinstance(obj, torch.Tensor):
            return None
        ref = self._index.get(id(obj))
        if ref is None:
            kind = "p" if isinstance(obj, torch.nn.Parameter) and obj.requires_grad else "t"
            ref = self._index[id(obj)] = f"{kind}{len(self.tensors)}"
            self.tensors.append(obj.detach())
        return ref


def file_items(rank: int, name: str, state: Any) -> dict[str, torch.Tensor]:
    """The DCP items of one DeepSpeed file ``name`` saved by ``rank`` (see the module docstring).

    The tree is pickled now (its non-tensor values are taken as they are at this call); the tensors are
    the live ones, copied by the save that takes the items.
    """
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(state)
    base = f"{PREFIX}/{rank}/{name}/"
    items: dict[str, torch.Tensor] = {base + PICKLE: torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)}
    for i, t in enumerate(p.tensors):
        items[base + str(i)] = t
    return items


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredFile:
    """One DeepSpeed file of a step: its name below the tag directory, the rank that saved it and its
    DCP keys (the pickle's first, then the tensors' in index order)."""

    name: str
    rank: int
    keys: tuple[str, ...]


def deepspeed_files(metadata: Metadata) -> dict[str, StoredFile]:
    """The DeepSpeed files of a step, by name, from its DCP metadata alone. A name saved by several
    ranks (the same file written by each) is taken from the lowest rank."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in metadata.state_dict_metadata:
        m = _FILE_KEY.fullmatch(key)
        if m:
            found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
    out: dict[str, StoredFile] = {}
    for (rank, name), parts in sorted(found.items()):
        if name in out or PICKLE not in parts:
            continue
        tensors = sorted((int(k), v) for k, v in parts.items() if k != PICKLE)
        out[name] = StoredFile(name=name, rank=rank, keys=(parts[PICKLE], *(v for _, v in tensors)))
    return out


def empty_state(metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors to ``dcp.load`` ``keys`` into: empty, of the stored shape and dtype."""
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointMismatchError(f"{key!r} is not a tensor in this step: not a gemini_dcp DeepSpeed step.")
        out[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return out


_TRUSTED_MODULES = frozenset({"deepspeed", "torch", "numpy", "collections", "argparse", "enum", "datetime", "decimal",
                                "fractions", "pathlib", "copyreg", "_codecs"})
_RECONSTRUCTORS = frozenset({"_reconstructor", "_reconstruct", "scalar", "encode", "_rebuild_tensor_v2", "_rebuild_parameter"})
_SAFE_BUILTINS = frozenset({"set", "frozenset", "slice", "complex", "range", "bytearray", "bytes", "dict", "list", "tuple",
                            "int", "float", "bool", "str", "object", "NoneType", "Ellipsis", "NotImplemented"})


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, tensor: Callable[[int], torch.Tensor]) -> None:
        super().__init__(buf)
        self._tensor = tensor

    def find_class(self, module: str, name: str) -> Any:
        top = module.split(".", 1)[0]
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module != "builtins" and top in _TRUSTED_MODULES:
            found = super().find_class(module, name)
            # classes and dtypes, and the few reconstructors of torch / numpy / copyreg: no other callable
            if isinstance(found, (type, torch.dtype)) or name in _RECONSTRUCTORS:
                return found
        raise UntrustedDataError(
            f"a DeepSpeed file's pickle names {module}.{name}, which gemini_dcp does not unpickle (allowed: plain "
            f"builtins, and classes of the modules {sorted(_TRUSTED_MODULES)}). The step was not written by DeepSpeed through "
            "gemini_dcp, or its client_state holds objects of other modules: keep client_state to plain values and tensors."
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, str) and pid[:1] in ("t", "p") and pid[1:].isdigit()):
            raise UntrustedDataError(f"unknown persistent id {pid!r} in a DeepSpeed file's pickle: not one gemini_dcp wrote.")
        t = self._tensor(int(pid[1:]))
        return torch.nn.Parameter(t) if pid[0] == "p" else t


def decode_file(f: StoredFile, values: Mapping[str, torch.Tensor]) -> Any:
    """The object tree of DeepSpeed file ``f`` from its loaded items (``values``: key -> tensor)."""
    tensors = f.keys[1:]

    def tensor(i: int) -> torch.Tensor:
        if i >= len(tensors):
            raise CheckpointMismatchError(f"{f.name}: its pickle names tensor {i}, the step holds {len(tensors)}.")
        return values[tensors[i]]

    raw = values[f.keys[0]]
    try:
        return _Unpickler(io.BytesIO(raw.numpy().tobytes()), tensor).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise UntrustedDataError(f"{f.name} (rank {f.rank}): its pickle does not decode ({type(exc).__name__}: {exc}).") from None


__all__ = [
    "PICKLE", "PREFIX", "TAG_BYTES", "TAG_KEY", "StoredFile", "decode_file", "deepspeed_files", "empty_state",
    "file_items", "is_deepspeed_step", "tag_item", "tag_template", "tag_value",
]
