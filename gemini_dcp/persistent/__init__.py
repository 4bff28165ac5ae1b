"""The persistent tier: the store, its step directories and reads, the stock DCP layout, the drain.

Names of the former flat module ``gemini_dcp.persistent`` (``PersistentTier`` and the like)
resolve on first use, through :mod:`gemini_dcp.persistent.store`.
"""

from .._aliases import forward_to

__getattr__ = forward_to(__name__, "store")
