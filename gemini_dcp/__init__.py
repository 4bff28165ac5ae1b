"""gemini_dcp: in-memory checkpoint tiers for PyTorch Distributed Checkpoint (after GEMINI, SOSP'23).

    import torch.distributed.checkpoint as dcp
    from gemini_dcp import GeminiStorageWriter, GeminiStorageReader

    dcp.save(state_dict, storage_writer=GeminiStorageWriter(job_id="run1"), checkpoint_id=step)
    reader = GeminiStorageReader(job_id="run1")
    dcp.load(state_dict, storage_reader=reader)   # newest restorable step
    print(reader.restored_step, reader.restored_from)
"""

from .errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    GeminiError,
    InvalidStepError,
    PeerError,
    PersistentTierError,
    ShardUnavailableError,
    StepNotFoundError,
    TierFullError,
    TierRootError,
    WorldSizeError,
    find_gemini_error,
)
from .reader import GeminiStorageReader
from .writer import GeminiStorageWriter

__version__ = "0.1.0"

__all__ = [
    "GeminiStorageWriter",
    "GeminiStorageReader",
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
    "find_gemini_error",
    "__version__",
]
