"""Drop-in wiring of gemini_dcp into trainers that already save with DCP.

- :mod:`gemini_dcp.integrations.resume` (pure): where to resume from — the newest step across
  gemini_dcp's tiers and a trainer's own checkpoint folder (``<folder>/step-<N>``).
- :mod:`gemini_dcp.integrations.lightning`, :mod:`gemini_dcp.integrations.accelerate`: per-step checkpoints of a
  Lightning / Accelerate loop into the tiers and the resume (the trainer imported only inside them).
- :mod:`gemini_dcp.integrations.torchtitan`: a torchtitan ``CheckpointManager`` that checkpoints every
  step into gemini_dcp's tiers beside torchtitan's own interval checkpoints (torchtitan imported lazily:
  ``import gemini_dcp`` and this package never need it).

This package sits above the DCP adapters (``gemini_dcp.dcp``); nothing below imports it.
docs/integrations.md has the lines to copy for torchtitan, plain ``dcp.save`` loops, ``dcp.async_save``,
Lightning and Accelerate.
"""
