"""gemini_dcp: in-memory checkpoint tiers for PyTorch Distributed Checkpoint (after GEMINI, SOSP'23).

    import torch.distributed.checkpoint as dcp
    from gemini_dcp import GeminiStorageWriter, GeminiStorageReader

    dcp.save(state_dict, storage_writer=GeminiStorageWriter(job_id="run1"), checkpoint_id=step)
    reader = GeminiStorageReader(job_id="run1")
    dcp.load(state_dict, storage_reader=reader)   # newest restorable step
    print(reader.restored_step, reader.restored_from)

Per-step zero-stall snapshots (``gemini_dcp.snapshot``): ``AsyncCheckpointer`` (recommended),
or ``AsyncGeminiStorageWriter`` for stock ``dcp.async_save`` (it is DCP's ``AsyncStager``).
"""

from typing import Any

from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    GeminiError,
    IncompatibleCheckpointError,
    InvalidStepError,
    JobConflictError,
    PeerError,
    PersistentTierError,
    RestartRequiredError,
    ShardUnavailableError,
    StepNotFoundError,
    TierFullError,
    TierRootError,
    UntrustedDataError,
    WorldSizeError,
    find_gemini_error,
)
from .reader import GeminiStorageReader
from .writer import GeminiStorageWriter

__version__ = "0.1.0"

_SNAPSHOT_API = ("AsyncCheckpointer", "AsyncGeminiStorageWriter", "InterleaveOptions")


def __getattr__(name: str) -> Any:
    """The async-snapshot API, imported on first use (it pulls in the interleaving machinery)."""
    if name in _SNAPSHOT_API:
        from . import snapshot  # noqa: PLC0415

        value = getattr(snapshot, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GeminiStorageWriter",
    "GeminiStorageReader",
    "AsyncCheckpointer",
    "AsyncGeminiStorageWriter",
    "InterleaveOptions",
    "GeminiError",
    "ConfigError",
    "InvalidStepError",
    "TierRootError",
    "TierFullError",
    "CheckpointNotFoundError",
    "StepNotFoundError",
    "ChecksumMismatchError",
    "ShardUnavailableError",
    "WorldSizeError",
    "PeerError",
    "PersistentTierError",
    "RestartRequiredError",
    "UntrustedDataError",
    "JobConflictError",
    "CheckpointMismatchError",
    "IncompatibleCheckpointError",
    "find_gemini_error",
    "__version__",
]
