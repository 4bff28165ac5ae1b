"""torchtitan's model state dict across saves, without a full ``model.state_dict()`` per save.

:class:`ModelStatesCache` is what :class:`~gemini_dcp.integrations.torchtitan.GeminiCheckpointManager`
saves as the model's part of the state: torchtitan's ``ModelWrapper`` dict, refreshed only where state-dict
hooks make values, with torchtitan's fused-qkv split computed from each rank's rows
(:mod:`gemini_dcp.integrations.fused_qkv`). torch is imported inside functions only (the integration
imports without it).
"""

from __future__ import annotations

import operator
from typing import Any

from ..options import DEFAULT_TIMEOUT_S
from .fused_qkv import FusedQKVSplit, split_makers


class ModelStatesCache:
    """torchtitan's model state dict (``ModelWrapper.state_dict()``) without a full ``model.state_dict()`` per save.

    ``ModelWrapper.state_dict()`` runs ``model.state_dict()`` at every call (module hooks, a DTensor
    ``detach`` per parameter: ~20 ms per save for the debugmodel on this project's CPU) and merges the
    result into its own cache dict: a value that shares storage with the cached one is left alone, a
    hook-made tensor (llama3's fused ``wqkv`` split into ``wq``/``wk``/``wv`` on save) is copied into the
    cached tensor, so the dict and its tensors stay the same objects from save to save.

    After one full call, :meth:`get` remembers which cached values share storage with the model's
    parameters or buffers (they track the parameters by themselves) and which modules make the others
    (their state-dict post hooks). While the model holds the same parameter and buffer objects (same
    names, same objects, same data pointers: ~1 us each to check) and the wrapper the same cache dict,
    a save calls ``state_dict()`` on those modules only and merges their values exactly as
    ``ModelWrapper.state_dict()`` does; the dict it returns is the one torchtitan's call would return,
    holding the same values. Anything it cannot vouch for — a wrapper of another class, a state-dict hook
    on a module that is not such a maker (only FSDP2's ``to_sharded`` pre hook is known), a maker
    nested in a hooked module, a parameter replaced or re-pointed (``p.data = ...``, a load) — takes
    torchtitan's full call. The hook modules run in the same order either way, so ranks that decide
    differently still issue the same collectives (the fused split's all-gathers) in the same order.
    Not thread-safe: the training thread's.
    """

    KNOWN_PRE_HOOKS = frozenset({"FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"})

    def __init__(self, wrapper_class: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.wrapper_class = wrapper_class  # torchtitan's ModelWrapper: only its state_dict() is known
        self.timeout_s = timeout_s  # the bound of the ranks' agreement on hits and splits
        self._own_comm: Any = None
        self._sd: dict[str, Any] | None = None
        self._key: tuple[Any, ...] | None = None
        self._objs: list[Any] = []  # the parameters and buffers the key refers to (held: ids stay theirs)
        self._makers: list[tuple[Any, str]] = []  # (module, its state-dict prefix), in module order
        self._splits: dict[int, FusedQKVSplit] = {}  # makers whose values come from local rows (by position)
        self._out: dict[str, Any] | None = None  # what get() returns: the wrapper's dict, or ours with the splits
        self.hits = 0
        self.rebuilds = 0

    def get(self, wrapper: Any) -> dict[str, Any]:
        """What ``wrapper.state_dict()`` returns, computed with the remembered makers when nothing changed.

        Collective when torch.distributed is initialized: all ranks call it at the same point (torchtitan's
        ``_save``, ``_load``), as torchtitan's own call with its all-gathering hooks; one small all-reduce on
        a gloo group of its own decides whether every rank reuses what it remembers."""
        known = self.wrapper_class is not None and type(wrapper) is self.wrapper_class
        cached = getattr(wrapper, "cached_state_dict", None)
        hit = False
        if known and self._sd is not None and self._sd is cached:
            objs, key = self._tensors(wrapper)
            hit = key == self._key and len(objs) == len(self._objs) and all(map(operator.is_, objs, self._objs))
        # Every rank takes the same branch: a rank that splits locally runs no all-gather, a rebuilding
        # rank runs torchtitan's (and each rebuild agrees on the splits).
        hit = _agree(hit, self._comm())
        if hit:
            assert cached is not None and self._out is not None
            for i, (module, prefix) in enumerate(self._makers):
                split = self._splits.get(i)
                if split is not None:
                    split.refresh()
                    continue
                fresh = module.state_dict(prefix=prefix)
                _merge(cached, fresh)  # as ModelWrapper.state_dict() merges
                if self._out is not cached:
                    self._out.update((k, cached[k]) for k in fresh)
            self.hits += 1
            return self._out
        sd: dict[str, Any] = wrapper.state_dict()
        self.rebuilds += 1
        self.forget()
        ok = known and sd is getattr(wrapper, "cached_state_dict", None) and self._remember(wrapper, sd)
        self._agree_splits(ok)
        return self._out if self._out is not None else sd

    def _comm(self) -> Any:
        """The agreement's group: gloo, of its own (the training thread's; the background commit uses the
        shared control group), made at the first :meth:`get` (collective, like every get)."""
        if self._own_comm is None:
            from ..transport.comm import own_comm  # noqa: PLC0415 - imports torch

            self._own_comm = own_comm(self.timeout_s)
        return self._own_comm

    def forget(self) -> None:
        """Drop what is remembered (the next :meth:`get` makes torchtitan's full call)."""
        self._sd = self._key = self._out = None
        self._objs, self._makers, self._splits = [], [], {}

    def _agree_splits(self, ok: bool) -> None:
        """Keep the fused splits only when every rank remembered its makers and split all of its fused ones
        (``ok`` on every rank; collective, after every rebuild): a rank whose fused maker runs torchtitan's hook
        all-gathers, so either every rank splits or none does."""
        if not _agree(ok, self._comm()) and self._splits:
            self._splits = {}
            self._out = self._sd

    def _remember(self, wrapper: Any, sd: dict[str, Any]) -> bool:
        """Remember ``sd``'s makers (and fused splits); True when remembered with every fused maker split."""
        objs, key = self._tensors(wrapper)
        storages = {_local(t).untyped_storage().data_ptr() for t in objs}
        made = [k for k, v in sd.items() if not (_is_tensor(v) and _local(v).untyped_storage().data_ptr() in storages)]
        makers: list[tuple[Any, str]] = []
        for part in wrapper.model:
            if type(part).state_dict is not _module_state_dict():
                return False
            hooked: list[str] = []  # prefixes of modules whose hooks a maker's own call would skip
            for name, module in part.named_modules(remove_duplicate=False):
                prefix = f"{name}." if name else ""
                if type(module).state_dict is not _module_state_dict():
                    return False
                pre = [getattr(f, "__qualname__", "") for f in module._state_dict_pre_hooks.values()]
                if any(q not in self.KNOWN_PRE_HOOKS for q in pre) or module._state_dict_hooks and not name:
                    return False  # a hook of unknown effect, or on the root: torchtitan's full call every save
                if module._state_dict_hooks:
                    if any(prefix.startswith(h) for h in hooked):
                        return False
                    hooked.append(prefix)
                    makers.append((module, prefix))
        if len(wrapper.model) > 1 and makers:
            return False  # makers of several parts: their prefixes are not the flattened keys' (torchtitan merges parts)
        prefixes = tuple(p for _, p in makers)
        if any(not k.startswith(prefixes) for k in made) or not all(map(_is_tensor, sd.values())):
            return False  # a value neither a parameter's nor a maker's, or not a tensor (extra state)
        self._sd, self._key, self._objs, self._makers = sd, key, objs, makers
        self._out = sd
        splits = split_makers(makers, sd)
        if splits:
            self._splits = splits
            self._out = dict(sd)
            for split in splits.values():
                self._out.update(split.values)
        return splits is not None

    @staticmethod
    def _tensors(wrapper: Any) -> tuple[list[Any], tuple[Any, ...]]:
        """(every parameter and buffer of the wrapped modules, (their names, their data pointers))."""
        names: list[str] = []
        objs: list[Any] = []
        for part in wrapper.model:
            for name, t in part.named_parameters(remove_duplicate=False):
                names.append(name)
                objs.append(t)
            for name, t in part.named_buffers(remove_duplicate=False):
                names.append(name)
                objs.append(t)
        return objs, (tuple(names), tuple(_local(t).data_ptr() for t in objs))


def _agree(flag: bool, comm: Any) -> bool:
    """True when ``flag`` is true on every rank of ``comm`` (one all-reduce, bounded by its timeout:
    RestartRequiredError past it); ``flag`` itself without torch.distributed."""
    from ..commit.agreement import min_all_reduce  # noqa: PLC0415 - imports torch

    if not comm.distributed:
        return flag
    return bool(min_all_reduce(comm, [int(flag)])[0])


def _merge(cached: dict[str, Any], fresh: dict[str, Any]) -> None:
    """``ModelWrapper.state_dict()``'s merge of freshly computed values into its cache dict."""
    for key, value in fresh.items():
        old = cached.get(key)
        if old is None or old.shape != value.shape or old.dtype != value.dtype:
            cached[key] = value
        elif _local(old).untyped_storage().data_ptr() != _local(value).untyped_storage().data_ptr():
            old.copy_(value)


def _module_state_dict() -> Any:
    import torch  # noqa: PLC0415 - only called once torch is imported (a torchtitan job)

    return torch.nn.Module.state_dict


def _local(t: Any) -> Any:
    """A DTensor's local tensor (its attribute, no autograd call), else the tensor."""
    return getattr(t, "_local_tensor", t)


def _is_tensor(v: Any) -> bool:
    import torch  # noqa: PLC0415 - only called once torch is imported (a torchtitan job)

    return isinstance(v, torch.Tensor)
