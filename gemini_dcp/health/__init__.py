"""Health-checked steps: NaN/Inf counted in the save's own pass, a step's health decided collectively.

- :mod:`~gemini_dcp.health.count` — the non-finite counts of items (the extension's fused
  copy+CRC+count, a vectorized torch fallback, CUDA on the device).
- :mod:`~gemini_dcp.health.rule` — the rule (more non-finite values in some item than the newest
  healthy step held), pure, judged by every rank from the commit gather.
- :mod:`~gemini_dcp.health.baseline` — which healthy step that is: the newest any rank's report
  proposes (the same on every rank, whichever nodes lost their memory), and a restore's handoff.

The mode (``nonfinite="mark"|"refuse"|"ignore"``) is :mod:`gemini_dcp.options.health`;
restores pick the newest healthy step (:mod:`gemini_dcp.core.restore_order`). docs/health.md.
"""

from .rule import Counts, StepHealth, is_healthy, judge, totals

__all__ = ["Counts", "StepHealth", "is_healthy", "judge", "totals"]
