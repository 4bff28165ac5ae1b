"""torchtitan's model state dict across saves, without a full ``model.state_dict()`` per save.

:class:`ModelStatesCache` is what :class:`~gemini_dcp.integrations.torchtitan.GeminiCheckpointManager`
saves as the model's part of the state: torchtitan's ``ModelWrapper`` dict, refreshed only where state-dict
hooks make values, with torchtitan's fused-qkv split computed from each rank's rows
(:mod:`gemini_dcp.integrations.fused_qkv`). torch is imported inside functions only (the integration
imports without it).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

from ..options import DEFAULT_TIMEOUT_S
from .fused_qkv import FusedQKVSplit, split_makers

log = logging.getLogger(__name__)


class ModelStatesCache:
    """torchtitan's model state dict (``ModelWrapper.state_dict()``) without a full ``model.state_dict()`` per save.

    ``ModelWrapper.state_dict()`` runs ``model.state_dict()`` at every call (module hooks, a DTensor
    ``detach`` per parameter: ~20 ms per save for the debugmodel on this project's CPU) and merges the
    result into its own cache dict: a value that shares storage with the cached one is left alone, a
    hook-made tensor (llama3's fused ``wqkv`` split into ``wq``/``wk``/``wv`` on save) is copied into the
    cached tensor, so the dict and its tensors stay the same objects from save to save.

    After one full call, :meth:`get` remembers which cached values share storage with the model's
    parameters or buffers (they track the parameters by themselves) and which modules make the others
    (*makers*: a module with a state-dict post hook, or one that cannot be seen through — a class of its
    own ``state_dict``/``_save_to_state_dict``, a state-dict pre hook of unknown effect — is recomputed by
    its own ``state_dict()`` call, its subtree with it). Wrappers whose only hook renames keys are seen
    through: torch's activation-checkpoint wrapper (torchtitan's AC) drops its ``_checkpoint_wrapped_module.``
    segment, so a maker under it is called with the key prefix the full call ends with (in-place
    ``module.compile()``, torchtitan's, changes no state dict). While the model holds the same parameter
    and buffer objects (same names, same objects, same data pointers: ~1 us each to check) and the
    wrapper the same cache dict, a save calls ``state_dict()`` on the makers only (a fused-qkv maker not
    even that: :mod:`~gemini_dcp.integrations.fused_qkv`) and merges their values exactly as
    ``ModelWrapper.state_dict()`` does; the dict it returns is the one torchtitan's call would return,
    holding the same values. What it cannot vouch for for the whole model — a wrapper of another class, a
    hook or own ``state_dict`` on a model part's root, makers of several parts, a value neither a
    parameter's nor a maker's, a parameter replaced or re-pointed (``p.data = ...``, a load) — takes
    torchtitan's full call; the log (rank 0, when it changes) names the makers recomputed per save and
    why, or why the full call. The hook modules run in the same order either way, so ranks that decide
    differently still issue the same collectives (the fused split's all-gathers) in the same order.
    Not thread-safe: the training thread's.
    """

    KNOWN_PRE_HOOKS = frozenset({"FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"})
    #: Post hooks that only rename their module's keys: (hook, the child-name segment they drop).
    RENAME_HOOKS = {"ActivationWrapper._post_state_dict_hook": "_checkpoint_wrapped_module"}

    def __init__(self, wrapper_class: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.wrapper_class = wrapper_class  # torchtitan's ModelWrapper: only its state_dict() is known
        self.timeout_s = timeout_s  # the bound of the ranks' agreement on hits and splits
        self._own_comm: Any = None
        self._sd: dict[str, Any] | None = None
        self._key: tuple[Any, ...] | None = None
        self._objs: list[Any] = []  # the parameters and buffers the key refers to (held: ids stay theirs)
        self._makers: list[tuple[Any, str, str]] = []  # (module, its key prefix, why a maker), in module order
        self._splits: dict[int, FusedQKVSplit] = {}  # makers whose values come from local rows (by position)
        self._out: dict[str, Any] | None = None  # what get() returns: the wrapper's dict, or ours with the splits
        self._walk: _Walk | None = None  # the module tree the key was taken from, to check it without a full walk
        self.hits = 0
        self.rebuilds = 0
        self.said = ""  # the last plan logged (rank 0): what is recomputed per save, or why the full call

    def get(self, wrapper: Any) -> dict[str, Any]:
        """What ``wrapper.state_dict()`` returns, computed with the remembered makers when nothing changed.

        Collective when torch.distributed is initialized: all ranks call it at the same point (torchtitan's
        ``_save``, ``_load``), as torchtitan's own call with its all-gathering hooks; one small all-reduce on
        a gloo group of its own decides whether every rank reuses what it remembers."""
        known = self.wrapper_class is not None and type(wrapper) is self.wrapper_class
        cached = getattr(wrapper, "cached_state_dict", None)
        hit = False
        if known and self._sd is not None and self._sd is cached:
            hit = self._same_tensors(wrapper)
        # Every rank takes the same branch: a rank that splits locally runs no all-gather, a rebuilding
        # rank runs torchtitan's (and each rebuild agrees on the splits).
        hit = _agree(hit, self._comm())
        if hit:
            assert cached is not None and self._out is not None
            for i, (module, prefix, _) in enumerate(self._makers):
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
        """The agreement's group: gloo, in a scope of its own (never a group another thread's collectives
        use), made at the first :meth:`get` (collective, like every get)."""
        if self._own_comm is None:
            from ..transport.comm import get_comm, new_scope  # noqa: PLC0415 - imports torch

            self._own_comm = get_comm(self.timeout_s, scope=new_scope("model-states"))
        return self._own_comm

    def forget(self) -> None:
        """Drop what is remembered (the next :meth:`get` makes torchtitan's full call)."""
        self._sd = self._key = self._out = None
        self._objs, self._makers, self._splits = [], [], {}
        self._walk = None

    def _agree_splits(self, ok: bool) -> None:
        """Keep the fused splits only when every rank remembered its makers and split all of its fused ones
        (``ok`` on every rank; collective, after every rebuild): a rank whose fused maker runs torchtitan's hook
        all-gathers, so either every rank splits or none does."""
        if not _agree(ok, self._comm()) and self._splits:
            self._splits = {}
            self._out = self._sd
        if self._sd is not None:
            per_save = [f"{p.rstrip('.')} ({why})" for i, (_, p, why) in enumerate(self._makers) if i not in self._splits]
            self._say("model states: reused at every save" + (
                f"; recomputed by their own state_dict() at every save: {', '.join(per_save)}" if per_save else ""))

    def _say(self, plan: str) -> None:
        """Log ``plan`` (rank 0) when it differs from the last one logged."""
        if plan != self.said:
            self.said = plan
            if _rank() == 0:
                log.info("gemini_dcp: %s", plan)

    def _remember(self, wrapper: Any, sd: dict[str, Any]) -> bool:
        """Remember ``sd``'s makers (and fused splits); True when remembered with every fused maker split."""
        objs, key = self._tensors(wrapper)
        storages = {_local(t).untyped_storage().data_ptr() for t in objs}
        made = [k for k, v in sd.items() if not (_is_tensor(v) and _local(v).untyped_storage().data_ptr() in storages)]
        makers: list[tuple[Any, str, str]] = []
        for part in wrapper.model:
            why = self._find_makers(part, "", makers, root=True)
            if why is not None:
                self._say(f"model states: torchtitan's full state_dict() at every save ({why})")
                return False
        if len(wrapper.model) > 1 and makers:  # their prefixes are not the flattened keys' (torchtitan merges parts)
            self._say("model states: torchtitan's full state_dict() at every save (makers in several model parts)")
            return False
        prefixes = tuple(p for _, p, _ in makers)
        stray = next((k for k in made if not k.startswith(prefixes)), None)
        if stray is not None or not all(map(_is_tensor, sd.values())):
            self._say("model states: torchtitan's full state_dict() at every save (" + (
                f"{stray!r} is neither a parameter's nor a maker's" if stray is not None else "a value is not a tensor") + ")")
            return False
        self._sd, self._key, self._objs, self._makers = sd, key, objs, makers
        self._walk = _Walk.of(wrapper)
        self._out = sd
        splits = split_makers([(m, p) for m, p, _ in makers], sd)
        if splits:
            self._splits = splits
            self._out = dict(sd)
            for split in splits.values():
                self._out.update(split.values)
        return splits is not None

    def _find_makers(self, module: Any, prefix: str, makers: list[tuple[Any, str, str]], *, root: bool = False) -> str | None:
        """Append the makers of ``module``'s subtree, in state-dict order, as (module, the key prefix its values end
        with in the full call, why); a maker's subtree is its own call's. None, or why the full call is needed
        (only a model part's root cannot be recomputed alone)."""
        cls = type(module)
        own = [f for f in ("state_dict", "_save_to_state_dict") if getattr(cls, f) is not getattr(_module_class(), f)]
        pre = [q for f in module._state_dict_pre_hooks.values() if (q := getattr(f, "__qualname__", "?")) not in self.KNOWN_PRE_HOOKS]
        post = [getattr(f, "__qualname__", "?") for f in module._state_dict_hooks.values()]
        drops = {self.RENAME_HOOKS.get(q) for q in post}
        why = (f"{cls.__name__}.{own[0]}" if own else f"state-dict pre hook {pre[0]}" if pre
               else f"state-dict post hook {', '.join(post)}" if None in drops else None)
        if why is not None:
            if root:
                return f"on the model's root: {why}"
            makers.append((module, prefix, why))
            return None
        for name, child in module._modules.items():
            if child is not None:
                inner = self._find_makers(child, prefix if name in drops else f"{prefix}{name}.", makers)
                if inner is not None:
                    return inner
        return None

    def _same_tensors(self, wrapper: Any) -> bool:
        """Whether the wrapped modules hold the remembered parameters and buffers (same names, same objects, same
        data pointers): what comparing :meth:`_tensors` with the remembered key decides, from the remembered module
        tree (checked node by node, each module's children, parameter and buffer names) instead of walking it with
        ``named_parameters``/``named_buffers`` (generators, a name string per tensor). Stricter than that walk, never
        looser: a submodule swapped for another holding the same parameters is a miss (one full call)."""
        assert self._walk is not None and self._key is not None  # remembered together with the dict (_remember)
        got = self._walk.tensors(wrapper)
        return (got is not None and len(got) == len(self._objs) and all(map(operator.is_, got, self._objs))
                and tuple(_local(t).data_ptr() for t in got) == self._key[1])

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


class _Walk:
    """The module tree of a wrapper's model parts as ``named_parameters(remove_duplicate=False)`` walks it: every
    module in that order with its children, parameter names and buffer names, so a later save can check that the
    tree is the same (each module's children the same objects, its names the same) and collect its tensors in the
    same order with plain loops. Any difference: None (a miss: the caller makes torchtitan's full call)."""

    __slots__ = ("parts", "parts_mods")

    def __init__(self, parts: tuple[Any, ...], parts_mods: list[list[tuple[Any, tuple[Any, ...], tuple[str, ...], tuple[str, ...]]]]) -> None:
        self.parts = parts
        self.parts_mods = parts_mods

    @classmethod
    def of(cls, wrapper: Any) -> _Walk:
        parts = tuple(wrapper.model)
        parts_mods = [[(m, tuple(m._modules.values()), tuple(m._parameters), tuple(m._buffers))
                       for _, m in part.named_modules(remove_duplicate=False)] for part in parts]
        return cls(parts, parts_mods)

    def tensors(self, wrapper: Any) -> list[Any] | None:
        """The parameters then buffers of each part, in ``named_parameters``/``named_buffers`` order; None when
        the tree or a name changed."""
        parts = wrapper.model
        if len(parts) != len(self.parts) or not all(map(operator.is_, parts, self.parts)):
            return None
        objs: list[Any] = []
        for mods in self.parts_mods:
            for m, kids, pnames, bnames in mods:
                if (tuple(m._modules.values()) != kids or tuple(m._parameters) != pnames
                        or tuple(m._buffers) != bnames):
                    return None
            objs.extend(p for m, _, _, _ in mods for p in m._parameters.values() if p is not None)
            objs.extend(b for m, _, _, _ in mods for b in m._buffers.values() if b is not None)
        return objs


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


def _module_class() -> Any:
    import torch  # noqa: PLC0415 - only called once torch is imported (a torchtitan job)

    return torch.nn.Module


def _rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    import torch.distributed as dist  # noqa: PLC0415 - only called once torch is imported

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local(t: Any) -> Any:
    """A DTensor's local tensor (its attribute, no autograd call), else the tensor."""
    return getattr(t, "_local_tensor", t)


def _is_tensor(v: Any) -> bool:
    import torch  # noqa: PLC0415 - only called once torch is imported (a torchtitan job)

    return isinstance(v, torch.Tensor)
