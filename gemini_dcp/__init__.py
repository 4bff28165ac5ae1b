"""gemini_dcp: in-memory checkpoint tiers for PyTorch Distributed Checkpoint (after GEMINI, SOSP'23).

    import torch.distributed.checkpoint as dcp
    from gemini_dcp import GeminiStorageWriter, GeminiStorageReader, newest_restorable_step

    dcp.save(state_dict, storage_writer=GeminiStorageWriter(job_id="run1"), checkpoint_id=step)
    reader = GeminiStorageReader(job_id="run1")
    step = newest_restorable_step(reader)         # all ranks; None: nothing to resume
    if step is not None:
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=step)

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
    UnhealthyStateError,
    UntrustedDataError,
    WorldSizeError,
    find_gemini_error,
)

__version__ = "0.1.0"

# Public names and the module that defines each; imported on first use, so that
# ``import gemini_dcp`` (and ``gemini_dcp.errors``) does not import torch.
_LAZY = {
    "GeminiStorageWriter": "gemini_dcp.dcp.writer",
    "GeminiStorageReader": "gemini_dcp.dcp.reader",
    "AsyncCheckpointer": "gemini_dcp.snapshot.checkpointer",
    "AsyncGeminiStorageWriter": "gemini_dcp.snapshot.async_writer",
    "InterleaveOptions": "gemini_dcp.snapshot.checkpointer",
    "newest_restorable_step": "gemini_dcp.dcp.discovery",
    "fast_load": "gemini_dcp.dcp.fast_load",
    "FastLoadResult": "gemini_dcp.dcp.fast_load",
    "init_optimizer_state": "gemini_dcp.dcp.optim_state",
}


def __getattr__(name: str) -> Any:
    """Public classes imported on first use."""
    import importlib  # noqa: PLC0415 - keeps the root light

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "GeminiStorageWriter",
    "GeminiStorageReader",
    "AsyncCheckpointer",
    "AsyncGeminiStorageWriter",
    "InterleaveOptions",
    "newest_restorable_step",
    "fast_load",
    "FastLoadResult",
    "init_optimizer_state",
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
    "UnhealthyStateError",
    "UntrustedDataError",
    "JobConflictError",
    "CheckpointMismatchError",
    "IncompatibleCheckpointError",
    "find_gemini_error",
    "__version__",
]
