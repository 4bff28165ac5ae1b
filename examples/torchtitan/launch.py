"""Run torchtitan's trainer on CPU (gloo) with gemini_dcp checkpoints: ``torchrun ... launch.py <torchtitan args>``.

Applies the CPU workarounds of ``cpu_patches.py`` (not needed on GPUs), then calls ``torchtitan.train.main()``.
Two switches for the kill-and-resume test, read from the environment:

- ``TITAN_FAIL_AT_STEP=K`` (+ ``TITAN_FAIL_RANK``, default 1): on the first attempt of the worker group
  (``TORCHELASTIC_RESTART_COUNT=0``) that rank SIGKILLs itself during step K, before its save;
- ``TITAN_DUMP_FINAL=PATH``: after training, rank 0 writes the full (unsharded) model parameters there.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_patches  # noqa: E402

cpu_patches.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


def _install_test_hooks() -> None:
    fail_at = int(os.environ.get("TITAN_FAIL_AT_STEP", "0"))
    fail_rank = int(os.environ.get("TITAN_FAIL_RANK", "1"))
    dump = os.environ.get("TITAN_DUMP_FINAL")
    train_step, train = Trainer.train_step, Trainer.train

    def train_step_maybe_die(self: Trainer, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if (fail_at and self.step == fail_at and dist.get_rank() == fail_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"injected failure: SIGKILL rank {fail_rank} during step {fail_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self, *args, **kwargs)

    def train_and_dump(self: Trainer) -> None:
        train(self)
        if dump:
            full = {}
            for part in self.model_parts:
                for name, p in part.state_dict().items():
                    full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            if dist.get_rank() == 0:
                torch.save(full, dump)

    Trainer.train_step = train_step_maybe_die  # type: ignore[method-assign]
    Trainer.train = train_and_dump  # type: ignore[method-assign]


if __name__ == "__main__":
    _install_test_hooks()
    from torchtitan.train import main

    main()
