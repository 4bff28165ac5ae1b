"""The validated options tree of gemini_dcp, and the only reader of ``GEMINI_DCP_*`` variables.

- :mod:`~gemini_dcp.options.env` — typed getters of one variable (ConfigError naming it and the fix).
- :mod:`~gemini_dcp.options.local` / :mod:`~.peer` / :mod:`~.persistent` — one frozen, slotted,
  kw-only dataclass per tier (the drain's :class:`DrainOptions` with the persistent tier), each
  validated in ``__post_init__`` with a message that says what to give instead.
- :mod:`~gemini_dcp.options.tree` — :class:`GeminiOptions` (the whole tree, ``from_env()``) and
  :func:`resolve_options` (the writer's and reader's ``options=`` merged with their keywords: the
  keywords are shorthand that build the tree; ``writer.options`` / ``reader.options`` is the tree).
- :mod:`~gemini_dcp.options.incremental` — :class:`IncrementalOptions` (``incremental``, ``full_every``).
- :mod:`~gemini_dcp.options.health` — ``nonfinite`` (``"mark"`` / ``"refuse"`` / ``"ignore"``, ``GEMINI_DCP_NONFINITE``):
  what a save does with NaN/Inf values (docs/health.md); a field of :class:`GeminiOptions`.
- :mod:`~gemini_dcp.options.faults` — the fault-injection test hooks.

The extension's variables (``GEMINI_DCP_EXT*``, ``GEMINI_DCP_CUDA_EXT``) are read by
``gemini_dcp.options.ext``. Everything here is torch-free.
"""

from .checks import DEFAULT_TIMEOUT_S, check_timeout
from .incremental import IncrementalOptions
from .local import DEFAULT_KEEP, DEFAULT_ROOT, LocalOptions
from .peer import PeerOptions
from .persistent import DrainOptions, PersistentOptions
from .tree import GeminiOptions, resolve_options

__all__ = [
    "DEFAULT_KEEP", "DEFAULT_ROOT", "DEFAULT_TIMEOUT_S", "DrainOptions", "GeminiOptions", "IncrementalOptions", "LocalOptions",
    "PeerOptions", "PersistentOptions", "check_timeout", "resolve_options",
]
