"""The slot files of one writer on this node: lookup, budget, space check, growth.

Every rank writes a step into one of ``keep + 1`` slot files of its own (a ring: the slot
of the step being saved is never one a kept step still uses, see
:meth:`gemini_dcp.local.tier.LocalTier.choose_slot`); peer replicas of another node's
ranks land in slots of those ranks on this node. A slot file is mapped once per writer
and grown in place (never shrunk) as a save needs it.

A slot file removed behind the writer's back (``rm``, a ``gc --force``) would keep taking
bytes that no restore can reach: a mapping whose file is no longer the one its path names is
dropped and the slot made anew (written in full) at its next use, and :meth:`SlotPool.check_linked`
fails a save whose slot went while it was written, before anything commits.

A writer's first ``keep + 1`` saves would each land in a new slot, and allocating fresh tmpfs
pages costs several times the copy itself; :meth:`SlotPool.prefault` grows the ring's other
slots in a background thread as soon as the first plan knows the sizes, so the second save of a
job costs what its tenth does. A slot is grown only under its ``lock`` (the one a save writes it
under), so a save never sees a slot half grown.

Local work only (no collective): each rank calls it for the slots it writes or receives.
"""

from __future__ import annotations

import logging
import threading

from ..errors import TierFullError, TierRootError
from ..local.slots import ALIGN, SlotFile, free_bytes, round_capacity, tier_full_message
from ..local.tier import LocalTier

log = logging.getLogger(__name__)


class SlotPool:
    """The mapped slot files of one writer, keyed by ``(rank, slot index)``.

    ``keep``: committed steps retained (the ring holds ``keep + 1`` slots per rank).
    ``capacity_bytes``: the job's budget on this node (None: only the free space bounds it).
    """

    def __init__(self, tier: LocalTier, *, keep: int, capacity_bytes: int | None) -> None:
        self.tier = tier
        self.keep = keep
        self.capacity_bytes = capacity_bytes
        self._slots: dict[tuple[int, int], SlotFile] = {}
        self._lock = threading.Lock()  # the slot map: the save's thread and the prefault thread
        self._prefaulted: set[tuple[int, int]] = set()

    def slot(self, rank: int, idx: int) -> SlotFile:
        """The slot file ``idx`` of ``rank`` on this node, created (empty) and mapped on first use."""
        with self._lock:
            return self._slot(rank, idx)

    def _slot(self, rank: int, idx: int) -> SlotFile:
        key = (rank, idx)
        slot = self._slots.get(key)
        if slot is not None and not slot.linked():
            log.warning("slot file %s was removed or replaced while this job ran (by hand, or a gc --force): made "
                        "anew; this save copies every item into it", slot.path)
            slot.close()
            slot = None
        if slot is None:
            path = self.tier.slot_path(rank, idx)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            slot = SlotFile(path)
            self._slots[key] = slot
        return slot

    def check_linked(self, rank: int, idx: int) -> None:
        """TierRootError when slot ``idx`` of ``rank`` is no longer the file its path names: its
        bytes would be committed where no restore finds them (the save fails; the previous step stays)."""
        slot = self._slots.get((rank, idx))
        if slot is not None and not slot.linked():
            raise TierRootError(
                f"slot file {slot.path} was removed or replaced while this save wrote it (by hand, or by "
                "`gemini-dcp gc --force` on a live job): this step is not committed and the previous one stays "
                "restorable. The next save makes the slot anew; keep other tools off a live job's tier root."
            )

    def choose(self, rank: int) -> int:
        """The slot index ``rank``'s next save (or replica) goes to (see ``LocalTier.choose_slot``)."""
        return self.tier.choose_slot(rank, self.keep)

    def grow(self, slot: SlotFile, nbytes: int) -> None:
        """Make ``slot`` hold ``nbytes``, within the budget and the free space (TierFullError)."""
        slot.ensure_capacity(nbytes, budget_check=self.budget_check)

    def budget_check(self, delta: int) -> None:
        """TierFullError when ``delta`` more bytes would take the job over ``capacity_bytes``."""
        cap = self.capacity_bytes
        if cap is not None:
            used = self.tier.usage_bytes()
            if used + delta > cap:
                raise TierFullError(
                    f"job {self.tier.job_id!r} would use {(used + delta) / 2**30:.3f} GiB in {self.tier.root}, over "
                    f"its capacity_bytes budget of {cap / 2**30:.3f} GiB: raise capacity_bytes or lower keep."
                )

    def prefault(self, rank: int, tensor_bytes: int, items: int) -> threading.Thread | None:
        """Grow ``rank``'s ring slots that cannot hold one save of ``tensor_bytes`` over ``items``
        items, in a background thread (returned; None when there is nothing to do).

        Each slot is grown once per (size, slot), under its ``lock`` taken without waiting: a slot a
        save is writing is left to that save. A failure (a full tier) is left to the save that
        needs the slot, which raises TierFullError itself. Call after :meth:`check_space`.
        """
        if tensor_bytes == 0:
            return None
        need = tensor_bytes + ALIGN * items
        todo = []
        for idx in range(self.keep + 1):
            key = (rank, idx)
            path = self.tier.slot_path(rank, idx)
            have = path.stat().st_size if path.exists() else 0
            if have < need and key not in self._prefaulted:
                self._prefaulted.add(key)
                todo.append(idx)
        if not todo:
            return None

        def run() -> None:
            for idx in todo:
                try:
                    slot = self.slot(rank, idx)
                    if not slot.lock.acquire(blocking=False):
                        continue  # a save is writing it: that save grows it
                    try:
                        slot.ensure_capacity(need, budget_check=self.budget_check)
                    finally:
                        slot.lock.release()
                except (OSError, TierFullError, TierRootError, ValueError) as exc:
                    log.debug("prefault of slot %d of rank %d skipped: %s", idx, rank, exc)

        thread = threading.Thread(target=run, name="gemini-slot-prefault", daemon=True)
        thread.start()
        return thread

    def check_space(self, rank: int, tensor_bytes: int, items: int) -> None:
        """Fail before writing when ``rank``'s ring of slots cannot fit in the tier root.

        ``tensor_bytes``: the planned tensor bytes of one save of ``items`` items.
        """
        if tensor_bytes == 0:
            # Nothing to reserve ahead (no tensor bytes; a few pickled items at most): the
            # write grows the slot to what it really needs, and checks the space then.
            return
        need = tensor_bytes + ALIGN * items
        cap = round_capacity(need)
        missing = 0
        for idx in range(self.keep + 1):
            path = self.tier.slot_path(rank, idx)
            have = path.stat().st_size if path.exists() else 0
            missing += max(0, cap - have)
        if missing:
            self.budget_check(missing)
            root = self.tier.root
            free = free_bytes(root)
            if missing > free:
                raise TierFullError(
                    tier_full_message(root, missing, free, f"{self.keep + 1} slots of {cap / 2**20:.1f} MiB for rank {rank}")
                )
