"""ReceiveArena (gemini_dcp.peer.arena): the peer-restore receive buffers in one pre-faulted mapping."""

from __future__ import annotations

import gc
import weakref

import torch

from gemini_dcp.peer import arena as peer
from gemini_dcp.peer.arena import ReceiveArena


def test_views_are_separate_page_aligned_and_writable() -> None:
    lengths = [5, 0, 4096, 3 << 20, 1]
    arena = ReceiveArena(lengths)
    arena.start_populate()
    arena.join()
    assert [v.numel() for v in arena.views] == lengths
    assert all(v.dtype == torch.uint8 for v in arena.views)
    assert all(v.data_ptr() % 4096 == 0 for v in arena.views if v.numel())  # any dtype view of a chunk is aligned
    for i, v in enumerate(arena.views):
        v.fill_(i + 1)
    for i, v in enumerate(arena.views):  # no chunk overlaps another
        assert bool((v == i + 1).all())
    assert arena.populated in (True, False)  # the worker ran (False: a kernel without MADV_POPULATE_WRITE)
    arena.release()
    assert arena.views == []


def test_empty_round_and_no_madvise_fallback(monkeypatch) -> None:
    assert ReceiveArena([]).views == []
    monkeypatch.setattr(peer, "_madvise", None)  # no ctypes libc: the GIL-holding mmap.madvise path
    arena = ReceiveArena([1 << 20])
    arena.start_populate()
    arena.join()
    arena.views[0].fill_(7)
    assert int(arena.views[0].sum()) == 7 << 20
    arena.release()


def test_mapping_lives_while_a_view_does() -> None:
    arena = ReceiveArena([8192])
    view = arena.views[0]
    view.fill_(3)
    ref = weakref.ref(arena)
    arena.release()
    del arena
    gc.collect()
    assert ref() is None
    assert int(view.sum()) == 3 * 8192  # the staged view still reads its bytes: the mapping went with the last view only
