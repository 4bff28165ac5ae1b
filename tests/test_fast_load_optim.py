"""gemini_dcp.init_optimizer_state: a fresh optimizer's state without torch's initializing step.

The resume path of the examples: ``init_optimizer_state`` → ``get_state_dict`` (no fake step now)
→ ``fast_load`` → the state put back. Checked against torch's own path (``get_state_dict``'s step
over zero gradients) and an uninterrupted run: the same state-dict structure (keys, order, types,
dtypes, devices, DTensor placements, strides), the same loaded bits, the same next training step,
bit for bit; plain tensors in one process, FSDP2 DTensors on 2 gloo ranks (with a resharding
restore that takes the ``dcp.load`` fallback); and every refusal leaves the optimizer untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks

from gemini_dcp import GeminiStorageWriter, fast_load, init_optimizer_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def root() -> Iterator[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-flo-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- helpers (also used by the 2-rank body) -------------------------------------------------------
def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 5, bias=False))


def _batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int = 0) -> torch.Tensor:
    loss = model(_batch(step, rank)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bits(t: Any) -> bytes:
    t = _local(t).detach().contiguous().cpu().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def _sig(sd: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The structure of a (nested) state dict, in order: what a load's plan depends on."""
    out: list[tuple[Any, ...]] = []

    def visit(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                visit(f"{prefix}.{k}", x)
        elif isinstance(v, torch.Tensor):
            loc = _local(v)
            out.append((prefix, type(v).__name__, v.dtype, v.device, tuple(v.shape), tuple(v.stride()), v.requires_grad,
                        v.grad_fn, str(getattr(v, "placements", None)), tuple(loc.shape), tuple(loc.stride()),
                        loc.is_contiguous()))
        else:
            out.append((prefix, repr(v)))

    visit("", sd)
    return out


def _state_bits(optim: torch.optim.Optimizer) -> list[tuple[str, bytes]]:
    return [(k, _bits(v)) for st in optim.state.values() for k, v in st.items()]


def _group_values(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def _resume(model: torch.nn.Module, optim: torch.optim.Optimizer, root: str, new: bool) -> tuple[str, str, list[Any]]:
    """One resume: (init_optimizer_state's answer, fast_load's path, the structure handed to the load)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    why = init_optimizer_state(optim) if new else "old path"
    msd, osd = get_state_dict(model, optim)
    sig = _sig({"model": msd, "optim": osd})
    res = fast_load({"model": msd, "optim": osd}, root=root, job_id="flo")
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    return why, res.path, sig


# ---- one process, plain tensors -------------------------------------------------------------------
CONFIGS = [
    (torch.optim.AdamW, {"weight_decay": 0.01, "foreach": True}),
    (torch.optim.Adam, {"amsgrad": True, "foreach": False}),
    (torch.optim.Adam, {"fused": True}),
]


@pytest.mark.parametrize(("cls", "kw"), CONFIGS, ids=["adamw-foreach", "adam-amsgrad", "adam-fused"])
def test_state_is_what_the_first_step_creates_and_training_is_unchanged(cls: Any, kw: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    a, b, c = _model(), _model(), _model()
    oa, ob, oc = cls(a.parameters(), lr=0.01, **kw), cls(b.parameters(), lr=0.01, **kw), cls(c.parameters(), lr=0.01, **kw)
    assert init_optimizer_state(oa) == ""
    assert all(float(st["step"]) == 0 for st in oa.state.values())
    assert all(float(v.abs().sum()) == 0 for st in oa.state.values() for v in st.values())
    # torch's way (a step over zero gradients) builds the same structure; only its step counts differ
    ta, tb = get_state_dict(a, oa)[1], get_state_dict(b, ob)[1]
    assert _sig(ta) == _sig(tb)
    assert [k for st in oa.state.values() for k in st] == [k for st in ob.state.values() for k in st]
    ob.state.clear()  # what the examples' forget_optimizer_init does after a load that found nothing
    # not loaded into: the optimizer trains exactly as a fresh one (its lazy initialization)
    for step in (1, 2):
        la, lc = _train(a, oa, step), _train(c, oc, step)
        assert _bits(la) == _bits(lc)
    assert [_bits(p) for p in a.parameters()] == [_bits(p) for p in c.parameters()]
    assert _state_bits(oa) == _state_bits(oc)


def test_resume_through_fast_load_is_bit_exact_and_continues_identically(root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = _model()
    oref = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
    for step in (1, 2):
        _train(ref, oref, step)
    oref.param_groups[0]["lr"] = 0.005  # a scheduler moved it: the resume must bring it back
    msd, osd = get_state_dict(ref, oref)
    dcp.save({"model": msd, "optim": osd}, storage_writer=GeminiStorageWriter(root=root, job_id="flo"), checkpoint_id=2)
    saved_params, saved_state = [_bits(p) for p in ref.parameters()], _state_bits(oref)
    want = _bits(_train(ref, oref, 3))

    runs = {}
    for new in (True, False):
        m = _model(seed=7)  # other initial values: everything must come from the checkpoint
        o = torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1)
        why, path, sig = _resume(m, o, root, new)
        assert path == "fast" and why == ("" if new else "old path")
        assert [_bits(p) for p in m.parameters()] == saved_params and _state_bits(o) == saved_state
        assert _group_values(o) == _group_values(oref)
        runs[new] = (sig, _bits(_train(m, o, 3)), [_bits(p) for p in m.parameters()], _state_bits(o))
    assert runs[True][0] == runs[False][0]  # the same structure handed to the load
    assert runs[True][1] == runs[False][1] == want  # the next step's loss
    assert runs[True][2:] == runs[False][2:] == ([_bits(p) for p in ref.parameters()], _state_bits(oref))


def _refused(optim: torch.optim.Optimizer) -> str:
    before = dict(optim.state)
    why = init_optimizer_state(optim)
    assert why and dict(optim.state) == before, why
    return why


def test_refusals_leave_the_optimizer_as_it_was() -> None:
    m = _model()
    assert "SGD is not one of" in _refused(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))

    class MyAdam(torch.optim.Adam):
        pass

    assert "MyAdam" in _refused(MyAdam(m.parameters()))
    o = torch.optim.AdamW(m.parameters())
    _train(m, o, 1)
    assert "already has state" in _refused(o)
    o = torch.optim.AdamW(m.parameters())
    next(iter(m.parameters())).grad = torch.zeros(8, 6)
    assert "gradient" in _refused(o)
    m.zero_grad(set_to_none=True)
    h = o.register_step_post_hook(lambda *a: None)
    assert "step hooks" in _refused(o)
    h.remove()
    # settings the optimizer's own step rejects: the probe step raises, torch's path reports it
    bad = torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01), foreach=False)
    bad.param_groups[0]["foreach"] = True  # accepted by the constructor only the other way
    assert "raised" in _refused(bad)
    assert init_optimizer_state(o) == "" and len(o.state) == 3  # once the hook is gone


def test_parameters_without_grad_get_no_state() -> None:
    m = _model()
    m[0].bias.requires_grad_(False)
    o = torch.optim.AdamW(m.parameters())
    assert init_optimizer_state(o) == ""
    assert m[0].bias not in o.state and len(o.state) == 2


# ---- two ranks, FSDP2 DTensors --------------------------------------------------------------------
def _fsdp(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, foreach=True)


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    ref, oref = _fsdp(world, 0)
    for step in (1, 2):
        _train(ref, oref, step, rank)
    oref.param_groups[0]["lr"] = 0.005
    msd, osd = get_state_dict(ref, oref)
    dcp.save({"model": msd, "optim": osd}, storage_writer=GeminiStorageWriter(root=root, job_id="flo"), checkpoint_id=2)
    saved = ([_bits(p) for p in ref.parameters()], _state_bits(oref))
    full = {k: v.full_tensor() for k, v in msd.items()}
    full_state = {(k, n): v.full_tensor() for k, st in osd["state"].items() for n, v in st.items() if isinstance(v, DTensor)}
    want = _bits(_train(ref, oref, 3, rank))
    after = ([_bits(p) for p in ref.parameters()], _state_bits(oref))

    for name, new in (("new", True), ("old", False)):
        m, o = _fsdp(world, 7)
        why, path, sig = _resume(m, o, root, new)
        dtensors = all(type(v) is DTensor for st in o.state.values() for k, v in st.items() if k != "step")
        exact = ([_bits(p) for p in m.parameters()], _state_bits(o)) == saved and _group_values(o) == _group_values(oref)
        loss = _bits(_train(m, o, 3, rank))
        out[name] = (why, path, sig, dtensors, exact, loss == want, ([_bits(p) for p in m.parameters()], _state_bits(o)) == after)

    # a restore into unsharded plain modules (resharding): fast_load falls back to dcp.load
    plain = _model(7)
    op = torch.optim.AdamW(plain.parameters(), lr=0.02, weight_decay=0.1)
    why, path, _ = _resume(plain, op, root, True)
    psd, posd = get_state_dict(plain, op)
    exact = all(torch.equal(psd[k], v) for k, v in full.items()) and all(
        torch.equal(posd["state"][k][n], v) for (k, n), v in full_state.items())
    out["resharded"] = (why, path, exact)
    return out


@pytest.mark.timeout(180)
def test_fsdp2_resume_without_the_initializing_step_matches_torchs_path(root: str) -> None:
    out = run_ranks(_two_ranks, 2, root, timeout=160)
    for r in out:
        new, old = r["new"], r["old"]
        assert new[0] == "" and new[1] == old[1] == "fast", (new[:2], old[:2])
        assert new[2] == old[2]  # the same structure handed to the load: DTensor specs, dtypes, devices, order
        assert new[3] and old[3]  # the state tensors are DTensors like the parameters
        assert new[4] and old[4]  # the loaded bits, param groups included
        assert new[5] and old[5] and new[6] and old[6]  # the next step: loss, parameters and state as uninterrupted
        assert r["resharded"] == ("", "dcp", True)
