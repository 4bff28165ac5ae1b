"""``TierOptions``: the flat options the writer and reader share (``writer.options``), validated on construction.

The same fields as :class:`~gemini_dcp.options.local.LocalOptions` (keep, checksum, capacity),
:class:`~gemini_dcp.options.peer.PeerOptions` and the top-level timeout, with the same
messages; :meth:`GeminiOptions.tier_options` builds one from the tree. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import DEFAULT_TIMEOUT_S, check_choice, check_int, check_optional_int, check_timeout
from .local import DEFAULT_KEEP, ChecksumAlgo
from .peer import OnPeerFailure, PlacementStrategy

__all__ = ["TierOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TierOptions:
    """Options shared by the writer and the reader, validated on construction."""

    keep: int = DEFAULT_KEEP
    replicas: int = 1
    placement: PlacementStrategy = "mixed"
    checksum: ChecksumAlgo = "auto"
    capacity_bytes: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_peer_failure: OnPeerFailure = "raise"

    def __post_init__(self) -> None:
        check_int(self.keep, "keep", minimum=1, fix=f"keep at least 1 committed step (default {DEFAULT_KEEP}).")
        check_int(self.replicas, "replicas", minimum=1, fix=(
            "replicas counts the node's own copy, so it must be an int >= 1 (2 = one extra copy on a peer node)."))
        check_choice(self.placement, "placement", ("mixed", "group", "ring"),
                     "choose 'mixed' (default), 'group' or 'ring'.")
        check_choice(
            self.checksum, "checksum", ("auto", "xxh3", "crc32c", "xsum64"),
            "choose 'auto' (default: crc32c when the C++ extension is built, else xxh3), 'xxh3', 'crc32c' or "
            "'xsum64' (the GPU checksum; CUDA tensors use it by default, see GEMINI_DCP_D2H_CHECKSUM).",
        )
        check_optional_int(self.capacity_bytes, "capacity_bytes", minimum=1, fix="give a positive byte budget or None.")
        check_timeout(self.timeout_s)
        check_choice(self.on_peer_failure, "on_peer_failure", ("raise", "degrade"),
                     "choose 'raise' (fail the save) or 'degrade' (commit with fewer replicas and warn).")
