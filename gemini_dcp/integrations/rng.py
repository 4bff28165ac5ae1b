"""A process's RNG states as tensors, saved beside a trainer's state and put back on resume.

Tensors only (torch CPU, CUDA where present, Python's ``random``, NumPy's global generator), so a restore
unpickles nothing. Each process saves its own under a key of its own (``rng_<rank>``): DCP keeps one copy of
a value that every process saves under the same key.
"""

from __future__ import annotations

import random

import torch


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (so no restore unpickles anything)."""
    version, internal, gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    try:
        import numpy as np  # noqa: PLC0415 - optional
    except ImportError:
        return out
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    out["numpy"] = torch.from_numpy(np.asarray(keys).astype(np.int64))
    out["numpy_rest"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`rng_state` took."""
    torch.set_rng_state(state["torch"])
    py = [int(v) for v in state["python"].tolist()]
    gauss = float(state["python_gauss"][0])
    random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))
    cuda = [state[f"cuda{i}"] for i in range(torch.cuda.device_count()) if f"cuda{i}" in state]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        import numpy as np  # noqa: PLC0415 - optional

        pos, has_gauss, cached = state["numpy_rest"].tolist()
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))


__all__ = ["rng_state", "set_rng_state"]
