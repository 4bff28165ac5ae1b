"""ModelStatesCache (gemini_dcp.integrations.model_states) against a stand-in of torchtitan's ModelWrapper, without
torchtitan: the dict it returns is torchtitan's, refreshed by the modules that make values (the makers) only; torch's
activation-checkpoint wrapper (torchtitan's AC) and in-place ``compile()`` are seen through, a module that cannot be
is recomputed alone (and named in the log), a hook on the model's root takes the full call."""

from __future__ import annotations

import logging
from typing import Any, Callable

import pytest
import torch
from titan_stub import ModelWrapperStub as _Wrapper
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from gemini_dcp.integrations.model_states import ModelStatesCache


def _fused_model() -> Any:
    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 4))
            self.register_state_dict_post_hook(self._split)

        @staticmethod
        def _split(module: Any, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
            w = sd.pop(f"{prefix}w")
            sd[f"{prefix}q"], sd[f"{prefix}k"] = w[:4].contiguous(), w[4:] * 1  # fresh tensors, as llama3's wqkv split

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.ModuleDict({"qkv": Fused()})
            self.out = torch.nn.Linear(4, 3)
            self.register_buffer("count", torch.zeros(1))

    return Net()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_model_states_cache_returns_what_the_wrapper_would() -> None:
    model = _fused_model()
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    first = cache.get(wrapper)
    assert first is wrapper.cached_state_dict and cache.rebuilds == 1
    with torch.no_grad():
        for step in range(3):  # in-place updates (the optimizer step): the cached dict, refreshed by the maker only
            for p in model.parameters():
                p.add_(0.5)
            model.count += 1
            got = cache.get(wrapper)
            assert got is first and _same(got, wrapper._get_state_dict())
    assert (cache.hits, cache.rebuilds) == (3, 1)
    ref = _Wrapper(model).state_dict()  # a fresh wrapper: what torchtitan would save now
    assert _same(cache.get(wrapper), ref)

    # A parameter replaced, or re-pointed: torchtitan's full call, and the new values.
    model.out.weight = torch.nn.Parameter(torch.ones(3, 4))
    assert _same(cache.get(wrapper), wrapper._get_state_dict()) and cache.rebuilds == 2
    with torch.no_grad():
        model.out.bias.data = torch.full((3,), 7.0)
    got = cache.get(wrapper)
    assert cache.rebuilds == 3 and torch.equal(got["out.bias"], torch.full((3,), 7.0))
    # The wrapper now holds a copy of the re-pointed bias (its cached tensor kept the old storage): a copy must be
    # refreshed by torchtitan's full call at every save.
    with torch.no_grad():
        model.out.bias.add_(1.0)
    assert torch.equal(cache.get(wrapper)["out.bias"], torch.full((3,), 8.0)) and (cache.hits, cache.rebuilds) == (4, 4)
    # A load replaces the wrapper's dict (torchtitan's ModelWrapper.load_state_dict): remembered again.
    wrapper.cached_state_dict = wrapper._get_state_dict()
    assert _same(cache.get(wrapper), wrapper._get_state_dict()) and cache.rebuilds == 5
    assert cache.get(wrapper) is wrapper.cached_state_dict and cache.hits == 5


def test_model_states_cache_declines_what_it_cannot_vouch_for(caplog: pytest.LogCaptureFixture) -> None:
    model = _fused_model()
    model.register_state_dict_pre_hook(lambda *a, **k: None)  # a hook of unknown effect on the root: the full call
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    with caplog.at_level(logging.INFO, logger="gemini_dcp.integrations.model_states"):
        for _ in range(3):
            assert _same(cache.get(wrapper), wrapper._get_state_dict())
    assert (cache.hits, cache.rebuilds) == (0, 3)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "full state_dict() at every save (on the model's root: state-dict pre hook" in said[0], said
    other = ModelStatesCache(dict)  # not the wrapper class it knows
    plain = _Wrapper(_fused_model())
    other.get(plain)
    other.get(plain)
    assert (other.hits, other.rebuilds) == (0, 2)


class _Block(torch.nn.Module):
    """A transformer block of the stand-in: a fused maker under ``attention``, plain parameters beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.ModuleDict({"qkv": _fused_model().attn["qkv"]})
        self.ff = torch.nn.Linear(4, 4)


def _ac_model(unknown_pre_hook: bool = False) -> Any:
    """torchtitan's llama3 under activation checkpointing, in small: every block in torch's checkpoint wrapper (a
    state-dict post hook that drops ``_checkpoint_wrapped_module.``, the fused maker's hook nested under it), one
    block compiled in place as torchtitan does; optionally a module with a pre hook of unknown effect."""
    net = torch.nn.Module()
    net.layers = torch.nn.ModuleDict({str(i): checkpoint_wrapper(_Block()) for i in range(3)})
    net.layers["1"].compile()
    net.norm = torch.nn.LayerNorm(4)
    if unknown_pre_hook:
        net.layers["2"].ff.register_state_dict_pre_hook(lambda *a, **k: None)
    return net


@pytest.mark.parametrize("unknown_pre_hook", [False, True])
def test_model_states_cache_sees_through_activation_checkpointing(unknown_pre_hook: bool, caplog: pytest.LogCaptureFixture) -> None:
    model = _ac_model(unknown_pre_hook)
    wrapper = _Wrapper(model)
    assert not [k for k in wrapper.cached_state_dict if "_checkpoint_wrapped_module" in k]  # keys as without AC
    cache = ModelStatesCache(_Wrapper)
    calls: list[str] = []
    for name, m in model.named_modules():  # every module's own part of a state_dict() call, counted (not a hook)
        m._save_to_state_dict = lambda *a, _name=name, _f=m._save_to_state_dict: (calls.append(_name), _f(*a))[1]
    with caplog.at_level(logging.INFO, logger="gemini_dcp.integrations.model_states"):
        first = cache.get(wrapper)
        ran: set[str] = set()
        with torch.no_grad():
            for _ in range(3):
                for p in model.parameters():
                    p.add_(0.5)
                calls.clear()
                got = cache.get(wrapper)
                ran.update(calls)
                assert got is first and _same(got, _Wrapper(model).state_dict())
    assert (cache.hits, cache.rebuilds) == (3, 1)
    # Only the makers ran (the fused modules, called with the keys their wrappers end with; the module with the
    # unknown hook), never a whole block or the model.
    makers = [f"layers.{i}._checkpoint_wrapped_module.attention.qkv" for i in range(3)]
    assert sorted(ran) == sorted(makers + (["layers.2._checkpoint_wrapped_module.ff"] if unknown_pre_hook else []))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "reused at every save; recomputed by their own state_dict() at every save:" in said[0], said
    assert "layers.0.attention.qkv (state-dict post hook _fused_model.<locals>.Fused._split)" in said[0]
    assert ("layers.2.ff (state-dict pre hook" in said[0]) == unknown_pre_hook


def test_model_states_cache_recomputes_an_opaque_wrapper_whole() -> None:
    """A wrapper whose post hook is not known to only rename keys: it and everything under it are one maker (its
    nested fused maker runs inside its call), the other blocks are still seen through."""
    model = _ac_model()
    model.layers["0"].register_state_dict_post_hook(lambda *a: None)
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    cache.get(wrapper)
    with torch.no_grad():
        for _ in range(2):
            for p in model.parameters():
                p.mul_(1.5)
            assert _same(cache.get(wrapper), _Wrapper(model).state_dict())
    assert (cache.hits, cache.rebuilds) == (2, 1)
    assert "layers.0 (state-dict post hook ActivationWrapper._post_state_dict_hook, test_model_states_cache_recomputes" in cache.said
    assert "layers.0.attention.qkv" not in cache.said and "layers.1.attention.qkv (" in cache.said


def _swap_ff(model: Any, _wrapper: Any) -> None:
    """layers.0's ``ff`` replaced by another Linear holding the same parameter objects."""
    block = model.layers["0"]._checkpoint_wrapped_module
    swapped = torch.nn.Linear(4, 4)
    swapped.weight, swapped.bias = block.ff.weight, block.ff.bias
    block.ff = swapped


TREE_CHANGES: dict[str, Callable[[Any, Any], None]] = {
    "a submodule swapped, same parameters": _swap_ff,
    "a buffer added": lambda m, w: m.norm.register_buffer("extra", torch.zeros(1)),
    "a parameter removed": lambda m, w: m.norm.register_parameter("bias", None),
    "a child added": lambda m, w: m.layers.__setitem__("3", torch.nn.Linear(2, 2)),
    "a parameter re-pointed": lambda m, w: setattr(m.norm.weight, "data", torch.ones(4)),
    "a model part replaced": lambda m, w: w.model.__setitem__(0, _ac_model()),
}


@pytest.mark.parametrize("change", list(TREE_CHANGES))
def test_model_states_cache_checks_the_remembered_tree_as_the_full_walk(change: str) -> None:
    """The per-save check reads the remembered module tree instead of walking ``named_parameters``: every change the
    full walk sees is a miss, and so is a submodule swapped for another holding the same parameters (the full walk
    would reuse: the check is stricter, never looser; a miss costs one full call, remembered again)."""
    model = _ac_model()
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    cache.get(wrapper)
    assert cache._walk is not None and cache._same_tensors(wrapper) is True

    def full_walk_hits() -> bool:
        objs, key = cache._tensors(wrapper)
        return key == cache._key and len(objs) == len(cache._objs) and all(a is b for a, b in zip(objs, cache._objs))

    with torch.no_grad():
        TREE_CHANGES[change](model, wrapper)
    assert cache._same_tensors(wrapper) is False
    assert full_walk_hits() is (change == "a submodule swapped, same parameters")
    got = cache.get(wrapper)  # torchtitan's full call: what its wrapper returns (stale keys included, as its)
    assert cache.rebuilds == 2 and _same(got, wrapper.state_dict())
