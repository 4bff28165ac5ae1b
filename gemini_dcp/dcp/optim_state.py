"""optim_state: a fresh optimizer's state, created as its first step would create it, without a step.

A resume needs tensors to load the optimizer's state into. torch's ``get_state_dict`` /
``get_optimizer_state_dict`` get them for an optimizer without state (``_init_optim_state``) by
running ``optimizer.step()`` over zero gradients with lr 0. Through DTensor (FSDP2) that first step
is DTensor's first sharding propagation of every foreach op, which can cost more than the tier read
of the whole checkpoint (docs/benchmarks.md). It also runs the optimizer's step
hooks and leaves Adam's step counters at 1.

:func:`init_optimizer_state` creates instead, for every parameter that requires a gradient, the
state the optimizer's own lazy initialization creates at its first step, before any update: the
same keys in the same order, the same dtypes and devices, DTensors with the parameter's mesh,
placements, shape and stride (built from its local shard, no communication), and the ``step``
tensor of the dtype and device the group's ``capturable`` / ``fused`` flags call for; zero-filled,
step 0. ``get_state_dict`` then finds state and skips its fake step; a load (``fast_load`` or
``dcp.load``) overwrites every tensor of it, in place. When nothing is loaded, the next
``step()`` trains exactly as a fresh optimizer's first one (it finds the state its lazy
initialization would have created).

The conventions are not written down here but read from the optimizer itself: for each distinct
(class, param-group settings, parameter dtype, device) a probe optimizer of the same class over one
plain 2×3 tensor runs one step with a zero gradient and lr 0 (no DTensor, cached), and
its state is the template: a tensor shaped like the probe's parameter becomes a tensor like the
parameter (its local shard for a DTensor) of the template's dtype; a 0-dim tensor becomes a 0-dim
tensor of the template's dtype and device.

Only optimizer classes whose lazy initialization is known to follow that rule are accepted:
``torch.optim.Adam`` and ``torch.optim.AdamW`` (exactly; a subclass may initialize differently).
Anything else is refused with the reason and nothing is changed, and ``get_state_dict`` does what it
always did: an unknown class, state already present, a gradient already set (torch skips its
initialization then too), optimizer step hooks (the fake step would run them), a parameter that is
not a dense tensor or DTensor, a complex parameter, ``fused`` with DTensor parameters, a probe step
that raises (settings the optimizer rejects: the real step will say why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["init_optimizer_state"]

_SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)

# (kind, dtype, device) per state key, in the optimizer's insertion order; kind "p" (like the
# parameter) or "s" (a 0-dim tensor). Keyed by the probe's inputs.
_Template = tuple[tuple[str, str, torch.dtype, torch.device], ...]
_templates: dict[tuple[Any, ...], _Template | str] = {}
_lock = threading.Lock()
_PROBE_SHAPE = (2, 3)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> str:
    """Give ``optimizer`` the state its first step would create, without running a step.

    Returns ``""`` when the state was created, else why not (then nothing was changed and torch's
    ``get_state_dict`` initializes the state its own way: a step over zero gradients). Local to this
    rank, **no collective**; call it on every rank before ``get_state_dict`` /
    ``get_optimizer_state_dict`` and the load that fills the state (``gemini_dcp.fast_load`` or
    ``dcp.load``). The state is zero-filled with step 0: if no checkpoint is loaded into it, the
    optimizer trains exactly as a fresh one. Supported: ``torch.optim.Adam`` and ``AdamW`` over
    plain tensors and DTensors (FSDP2); see the module's documentation for what is refused.
    """
    why = _refusal(optimizer)
    if why:
        return why
    built: list[tuple[torch.Tensor, dict[str, Any]]] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                template = _template(optimizer, group, p)
                if isinstance(template, str):
                    return template
                built.append((p, {key: _make(p, kind, dtype, device) for key, kind, dtype, device in template}))
    for p, state in built:  # all or nothing: nothing is installed before every parameter's state is built
        optimizer.state[p] = state
    return ""


def _refusal(optimizer: torch.optim.Optimizer) -> str:
    """Why ``optimizer``'s state is not created here ("" when it is)."""
    if type(optimizer) not in _SUPPORTED:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in _SUPPORTED)
        return f"{type(optimizer).__name__} is not one of the optimizers whose state is created without a step ({names})"
    if optimizer.state:
        return "the optimizer already has state"
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks  # noqa: PLC0415

    if (getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
            or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
        return "the optimizer has step hooks (torch's initializing step would run them)"
    dtensor = _dtensor_type()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return "a parameter already has a gradient (torch does not initialize the state then either)"
            is_d = dtensor is not None and type(p) is dtensor
            if not is_d and type(p) not in (torch.Tensor, torch.nn.Parameter):
                return f"a parameter is a {type(p).__name__}, not a tensor or DTensor"
            local = p._local_tensor if is_d else p
            if local.layout != torch.strided or local.is_complex() or local.is_quantized:
                return "a parameter is sparse, complex or quantized"
            if is_d and group.get("fused"):
                return "fused=True with DTensor parameters"
    return ""


def _template(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor) -> _Template | str:
    """The state template of ``p`` in ``group`` (cached per class, settings, dtype and device)."""
    settings = tuple(sorted((k, _hashable(v)) for k, v in group.items() if k != "params"))
    key = (type(optimizer), settings, p.dtype, p.device, torch.get_default_dtype())
    with _lock:
        got = _templates.get(key)
    if got is None:
        got = _probe(type(optimizer), group, p.dtype, p.device)
        with _lock:
            _templates[key] = got
    return got


def _probe(cls: Callable[..., torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype,
           device: torch.device) -> _Template | str:
    """One step of a ``cls`` over a zero-gradient 2×3 tensor with ``group``'s settings (lr 0): the
    template of its state, or why it does not fit the rule (or the step raised)."""
    try:
        probe = torch.zeros(_PROBE_SHAPE, dtype=dtype, device=device, requires_grad=True)
        opt = cls([probe])
        opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        lr = group.get("lr", 0.0)
        opt.param_groups[0]["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        probe.grad = torch.zeros_like(probe)
        opt.step()
    except Exception as exc:  # noqa: BLE001 - the settings the real step rejects: torch's own path reports it
        return f"a probe step of {cls.__name__} with these settings raised {type(exc).__name__}: {exc}"
    out: list[tuple[str, str, torch.dtype, torch.device]] = []
    for k, v in opt.state[probe].items():
        if not isinstance(v, torch.Tensor) or type(v) is not torch.Tensor:
            return f"the optimizer's state {k!r} is a {type(v).__name__}, not a tensor"
        if tuple(v.shape) == _PROBE_SHAPE and v.device == probe.device:
            out.append((k, "p", v.dtype, v.device))
        elif v.dim() == 0:
            out.append((k, "s", v.dtype, v.device))
        else:
            return f"the optimizer's state {k!r} has shape {tuple(v.shape)}, neither the parameter's nor a scalar"
    return tuple(out)


def _make(p: torch.Tensor, kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero state tensor: 0-dim of ``dtype`` on ``device``, or like ``p`` (a DTensor like a DTensor ``p``)."""
    if kind == "s":
        return torch.zeros((), dtype=dtype, device=device)
    dtensor: Any = _dtensor_type()
    is_d = dtensor is not None and type(p) is dtensor
    if is_d:
        d: Any = p
        local = torch.zeros_like(d._local_tensor, dtype=dtype, memory_format=torch.preserve_format)
        out: torch.Tensor = dtensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape,
                                               stride=d.stride())
        return out
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def _hashable(v: Any) -> Any:
    if isinstance(v, float):
        return float  # a value (lr, eps, ...) does not change the template, its type might
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.device, tuple(v.shape))  # values do not change the template
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415
    except ImportError:  # a torch built without distributed
        return None
    return DTensor
