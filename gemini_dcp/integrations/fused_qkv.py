"""torchtitan's fused ``wqkv`` split, computed from each rank's own rows: no all-gather per save.

torchtitan's ``FusedQKVLinear`` keeps one ``wqkv`` projection and saves it in the stock layout
(``wq``/``wk``/``wv``) through a state-dict post hook that first redistributes the FSDP-sharded
``wqkv`` to ``Replicate`` (an all-gather per layer and parameter), then splits it into three fresh
replicated tensors. On a per-step checkpoint that hook is most of the training thread's cost of a save
(docs/benchmarks.md), and it saves every split tensor whole on every rank.

The rows of ``wqkv`` are ``n_kv`` groups of ``r_dim = heads_per_kv + 2`` heads of ``head_dim`` rows
(``heads_per_kv`` query heads, one key head, one value head). When ``wqkv`` is ``Shard(0)`` on a 1-D
mesh and every rank holds the same whole number of groups, rank ``i``'s rows of ``wq``/``wk``/``wv`` are
exactly the query/key/value heads of its own groups: :class:`FusedQKVSplit` copies them from the local
shard into three buffers of its own (stable storage: the same tensors at every save) and presents them as
``Shard(0)`` DTensors of the stock global shapes. The values are bit for bit those of torchtitan's hook
(checked once per build against the hook's own output, which the caller passes in); only their placement
differs (``Shard(0)`` like the parameter, not ``Replicate``), which DCP reshards on load either way.

Anything else (another hook, a 2-D mesh, uneven groups, a mismatch with the hook's output) gets no split:
the caller keeps calling torchtitan's hook. The decision reads global facts (shapes, mesh size,
placements) and the hook's values; the caller agrees on it across the ranks
(:class:`~gemini_dcp.integrations.torchtitan.ModelStatesCache`), since a rank that keeps the hook
all-gathers and one that splits locally does not.
"""

from __future__ import annotations

from typing import Any

#: The torchtitan hook this module stands in for (``FusedQKVLinear._split_qkv_on_save``, torchtitan 0.3).
SPLIT_HOOK = "FusedQKVLinear._split_qkv_on_save"


def _hook_names(module: Any) -> list[str]:
    return [getattr(h, "__qualname__", "") for h in module._state_dict_hooks.values()]


class FusedQKVSplit:
    """The ``wq``/``wk``/``wv`` values of one ``FusedQKVLinear`` (state-dict prefix ``prefix``), from local rows.

    Build with :meth:`build` (None when the split does not apply); :meth:`refresh` copies the current
    rows into the buffers (local copies only, no collective); :attr:`values` maps the stock keys to the
    ``Shard(0)`` DTensors over those buffers (the same objects at every refresh).
    """

    def __init__(self, copies: list[tuple[Any, Any]], values: dict[str, Any]) -> None:
        self._copies = copies  # (destination view, source view of the parameter's local rows)
        self.values = values

    def refresh(self) -> None:
        """Copy the parameter's current rows into the buffers (the training thread's, under no_grad)."""
        for dst, src in self._copies:
            dst.copy_(src)

    @classmethod
    def build(cls, module: Any, prefix: str, made: dict[str, Any]) -> FusedQKVSplit | None:
        """The split for ``module`` when it applies, checked against ``made`` (torchtitan's hook output for
        this module, keyed as in the state dict); None otherwise."""
        import torch  # noqa: PLC0415 - torchtitan jobs only
        from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415

        if _hook_names(module) != [SPLIT_HOOK]:
            return None
        try:
            hd, hpk, r = int(module.head_dim), int(module.heads_per_kv), int(module.r_dim)
        except (AttributeError, TypeError, ValueError):
            return None
        if r != hpk + 2 or hd <= 0 or hpk <= 0:
            return None
        copies: list[tuple[Any, Any]] = []
        values: dict[str, Any] = {}
        mesh: Any = None
        for param in ("weight", "bias"):
            p = getattr(getattr(module, "wqkv", None), param, None)
            keys = [f"{prefix}{name}.{param}" for name in ("wq", "wk", "wv")]
            if p is None:
                if any(k in made for k in keys):
                    return None
                continue
            if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                return None
            mesh = p.device_mesh
            world = mesh.size()
            rows = p.shape[0]
            local = p._local_tensor
            if rows % (world * r * hd) or local.shape[0] != rows // world or not local.is_contiguous():
                return None
            groups = rows // world // (r * hd)  # whole kv groups on this rank
            tail = tuple(p.shape[1:])
            if len(tail) > 1:
                return None
            heads = local.view(groups, r, hd, *tail)
            for key, lo, n in zip(keys, (0, hpk, hpk + 1), (hpk, 1, 1)):
                buf = torch.empty((groups * n * hd, *tail), dtype=local.dtype, device=local.device)
                shape = torch.Size((rows // r * n, *tail))
                stride = (tail[0], 1) if tail else (1,)
                values[key] = DTensor.from_local(buf, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
                copies.append((buf.view(groups, n, hd, *tail), heads[:, lo : lo + n]))
        if not values or set(values) != set(made):  # the hook made exactly these keys for this module
            return None
        split = cls(copies, values)
        split.refresh()
        for key, ours in values.items():  # the hook's own values, once: any difference and no split
            theirs = made.get(key)
            if not isinstance(theirs, DTensor) or any(not isinstance(pl, Replicate) for pl in theirs.placements):
                return None
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                return None
            n = ours._local_tensor.shape[0]
            at = mesh.get_local_rank() * n
            if not torch.equal(theirs._local_tensor[at : at + n], ours._local_tensor):
                return None
        return split


def split_makers(makers: list[tuple[Any, str]], sd: dict[str, Any]) -> dict[int, FusedQKVSplit] | None:
    """For each maker (module, prefix) of ``sd`` whose hook is torchtitan's fused split: its split, by position;
    None when one of them cannot be split (that module keeps torchtitan's hook, so no rank may split)."""
    out: dict[int, FusedQKVSplit] = {}
    for i, (module, prefix) in enumerate(makers):
        if SPLIT_HOOK in _hook_names(module):
            made = {k: v for k, v in sd.items() if k.startswith(prefix)}
            split = FusedQKVSplit.build(module, prefix, made)  # None for any other hook beside it, too
            if split is None:
                return None
            out[i] = split
    return out
