"""The operator's view of XOR parity: parity slots and groups (``inspect``), their checks (``verify``).

A node sees only its own data, so ``verify`` cannot recompute a parity (it is the XOR of the
other members' stripes): it checks each parity slot held here against the checksum its step
record names, and says that the recomputation needs the whole group
(:func:`recompute_parity` does it when every member's tier root is visible, e.g. simulated
nodes on one machine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..core.checksum import checksum
from ..local.job_dir import JobLayout
from ..local.parity_record import parity_path
from ..local.record_types import StepRecord
from ..local.slots import ReadOnlySlot

__all__ = ["parity_checks", "parity_info"]

Check = tuple[str, int, int, Callable[[], tuple[str, str]]]  # (what, rank, nbytes, run -> (status, detail))


def parity_info(layout: JobLayout, rec: StepRecord) -> dict[str, Any] | None:
    """The parity of a step as this node holds it: groups, lanes and this node's parity slots
    (file, bytes of parity, bytes of the data slot it protects); None without parity."""
    par = getattr(rec, "parity", None)
    if par is None:
        return None
    slots = []
    for s in rec.slots:
        if s.rank >= len(par.parity_nbytes) or not par.parity_nbytes[s.rank]:
            continue
        path = parity_path(layout.rank_dir(s.rank), s.slot)
        try:
            size: int | None = path.stat().st_size
        except FileNotFoundError:
            size = None
        slots.append({"rank": s.rank, "slot": s.slot, "path": str(path), "parity_bytes": par.parity_nbytes[s.rank],
                      "data_bytes": s.nbytes, "file_bytes": size})
    return {
        "group": par.group, "groups": [list(g) for g in par.groups], "lanes": [list(lane) for lane in par.lanes],
        "stripes": list(par.stripes), "slots": slots,
        "parity_bytes_here": sum(x["parity_bytes"] for x in slots),
        "data_bytes_here": sum(x["data_bytes"] for x in slots),
    }


def parity_checks(layout: JobLayout, rec: StepRecord) -> list[Check]:
    """One check per parity slot held here: its recorded checksum (the parity itself cannot be
    recomputed from one node's data; the detail says so)."""
    par = getattr(rec, "parity", None)
    if par is None:
        return []
    out: list[Check] = []
    for s in rec.slots:
        if s.rank >= len(par.parity_nbytes) or not par.parity_nbytes[s.rank]:
            continue
        path = parity_path(layout.rank_dir(s.rank), s.slot)
        n = par.parity_nbytes[s.rank]
        lane = par.lanes[par.lane_index(s.rank) or 0]
        others = [r for r in lane if r != s.rank]

        def run(path: Path = path, n: int = n, want: int = par.checksums[s.rank], others: list[int] = others) -> tuple[str, str]:
            try:
                m = ReadOnlySlot(path)
            except FileNotFoundError:
                return "missing", f"parity slot {path} is missing"
            if m.size < n:
                return "missing", f"parity slot {path} ends at {m.size}, the parity needs {n} bytes"
            if checksum(m.view(0, n), par.algo) != want:
                return "bad", (f"parity slot {path} fails its {par.algo} checksum: it is corrupt; a lost node of its "
                               "group could not be rebuilt from it (the next save rewrites it)")
            return "ok", (f"checksum ok; recomputing the parity needs the data of ranks {others} on the other nodes "
                          "of its group, not visible here")

        out.append((f"<parity of rank {s.rank}>", s.rank, n, run))
    return out
