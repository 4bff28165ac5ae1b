"""Copy a save's small items into the slot, checksummed, with as few Python-level calls as possible.

:class:`gemini_dcp.save.local_write.LocalWriter` copies the small CPU items of a plan in groups
of at most ``block`` bytes (one pacer call per group). This module does the copy of one
group and the bookkeeping that makes it cheap at hundreds or thousands of items:

* **fused** (``crc32c`` with the C++ extension loaded): each item is copied and CRC'd in one
  pass by the extension's ``copy_with_crc32c`` (one thread, the GIL released), cheaper than
  ``torch._foreach_copy_`` followed by one ``crc32c``-package call per item over the slot
  (figures: docs/benchmarks.md). The op takes flat ``uint8`` views of source and destination;
  making a source view costs more than copying a small item, so :class:`SourceViews` makes them
  once and keeps them while the sources stay where they are (checked every save: their data
  pointers with one C-level map, and their contiguity). Views are kept only once the pointers were seen unchanged
  by two saves in a row: a state dict made of fresh tensors at every save (a copy per step)
  takes the other way and holds nothing of them.
* otherwise: one ``torch._foreach_copy_`` per group, then one checksum call per item over a
  memoryview of the slot (``crc32c`` package or ``xxhash``).

Both give, for each item, the checksum :func:`gemini_dcp.core.checksum.checksum` gives for its
bytes in the slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.checksum import copy_crc32c_many

__all__ = ["SourceViews", "copy_group", "fused_available"]

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous


def fused_available(algo: str) -> bool:
    """Whether the grouped copy of ``algo`` runs fused (copy + CRC in one pass per item)."""
    return algo == "crc32c" and copy_crc32c_many([], []) is not None


class SourceViews:
    """The flat ``uint8`` views of one program's grouped source tensors, kept while they stay put.

    ``views(srcs)``: the views of ``srcs`` (one list over every group, in group order), or None
    when they cannot be used for this save (first sight of these pointers, or a source not
    contiguous): the caller then copies with ``_foreach_copy_``. The shapes and dtypes of
    ``srcs`` are the program's (checked by the caller), so a source at the same address with
    the same contiguous layout has exactly the bytes its kept view reads: the kept view holds
    its storage alive, so no other storage can have been put at that address since.
    """

    __slots__ = ("_ptrs", "_views")

    def __init__(self) -> None:
        self._ptrs: list[int] | None = None
        self._views: list[torch.Tensor] | None = None

    def views(self, srcs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        ptrs = list(map(_data_ptr, srcs))
        if ptrs != self._ptrs or not all(map(_is_contiguous, srcs)):
            self._ptrs, self._views = ptrs, None  # moved, or first sight: nothing kept
            return None
        if self._views is None:  # the second save in a row with the sources in place
            self._views = [t.reshape(-1).view(torch.uint8) for t in srcs]
        return self._views

    def drop(self) -> None:
        """Forget the views (and the storages they hold)."""
        self._ptrs = self._views = None


def copy_group(
    dsts: list[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    *,
    dst_bytes: list[torch.Tensor] | None,
    src_bytes: list[torch.Tensor] | None,
    slot_view: memoryview,
    spans: list[tuple[int, int]],
    hasher: Callable[[Any], int],
) -> list[int]:
    """Copy one group's ``srcs`` into their slot views ``dsts`` and return each item's checksum.

    Fused when both byte-view lists are given (``copy_with_crc32c`` per item); else one
    ``torch._foreach_copy_`` and ``hasher`` over each item's ``(offset, length)`` span of
    ``slot_view``.
    """
    if dst_bytes is not None and src_bytes is not None:
        sums = copy_crc32c_many(dst_bytes, src_bytes)
        if sums is not None:
            return sums
    torch._foreach_copy_(dsts, list(srcs))
    return [hasher(slot_view[o : o + n]) for o, n in spans]
