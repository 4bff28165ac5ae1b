"""The CPU workarounds torchtitan 0.3.0 needs to train the llama3 debugmodel on CPU with gloo.

Example code, not library code: none of this is needed on GPUs (NCCL, CUDA, FlexAttention kernels).
``apply()`` must run before the rest of torchtitan is imported (``launch.py`` calls it first):

- the device falls back to "cuda" when no accelerator is found (``torchtitan/tools/utils.py``):
  make it "cpu", with a device module carrying the memory-stat calls ``components/metrics.py`` makes;
- ``distributed/minimal_async_ep/kernels.py`` imports ``triton`` (not installed on CPU): a stub;
- FlexAttention has no CPU backward: run SDPA over the dense mask built from the same mask function;
- gloo has no ``PREMUL_SUM``: FSDP2 reduces with plain SUM (``set_force_sum_reduction_for_comms``);
- ``torch.distributed.set_timeout`` does not exist in torch 2.13: a no-op.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


class _CpuDevice:
    """The calls torchtitan makes on ``torch.cuda``, answered for the CPU (anything else: ``torch.cpu``'s)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(*_: Any) -> None:
        pass

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(*_: Any) -> Any:
        import psutil

        return types.SimpleNamespace(total_memory=psutil.virtual_memory().total, name="cpu")

    @staticmethod
    def memory_stats(*_: Any) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(*_: Any) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def is_available() -> bool:
        return True


def _stub_triton() -> None:
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    # Only torchtitan's expert-parallel kernels import it (never run here); torch must not see a
    # "real" triton, so the stub is removed from sys.modules once torchtitan's import is done.
    class _Anything:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self

        def __getattr__(self, name: str) -> Any:
            return self

    import torchtitan.distributed  # noqa: F401 - torch's own modules imported before the stub exists

    tl = types.ModuleType("triton.language")
    def anything(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # inspect and importlib probe modules for dunders
        return _Anything()

    tl.__getattr__ = anything  # type: ignore[attr-defined]
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.language = tl  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = triton, tl
    try:
        import torchtitan.distributed.minimal_async_ep.kernels  # noqa: F401
    finally:
        sys.modules.pop("triton", None)
        sys.modules.pop("triton.language", None)


def _sdpa_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):  # noqa: ANN001, ANN202
    """FlexAttention's call, computed by SDPA over the dense mask of the same ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise NotImplementedError("the CPU stand-in for FlexAttention handles masks only, not score_mod")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


def apply() -> None:
    """Patch torchtitan for CPU training. Call before importing torchtitan.train / trainer."""
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _CpuDevice()
    _stub_triton()

    from torchtitan.models.common import attention

    attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_flex)  # type: ignore[method-assign]

    from torch.distributed.fsdp import FSDPModule

    set_divide = FSDPModule.set_gradient_divide_factor

    def set_divide_with_sum(self: FSDPModule, factor: float) -> None:
        set_divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    FSDPModule.set_gradient_divide_factor = set_divide_with_sum  # type: ignore[method-assign]

    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None  # type: ignore[attr-defined]
