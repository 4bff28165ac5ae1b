"""One launch, whatever started the ranks: every way a process group is initialized.

One run of 4 real processes (gloo on CPU) plays several launches in turn, each a pair of ranks
on one tier root (one node, as every rank of a host shares /dev/shm):

- two live launches on one job and root at once (one ``tcp://``, one ``file://``): the second
  is refused with JobConflictError and the first keeps saving and restoring its steps;
- then each pair re-initializes its group by another method — ``tcp://``, a ``Store`` passed
  in, ``file://``, and ``env://`` with the rank variables set by hand as under ``srun`` — and
  saves twice and restores: the two ranks agree on one launch id, new for every launch.

Last, a writer built before ``init_process_group`` moves to the launch its ranks agree on at its
first save. torchrun and ``mp.spawn`` with ``env://`` are what the rest of the suite runs.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import pytest
from mp_utils import free_port, node_root_factory, run_ranks

make_roots, _cleanup = node_root_factory("gemini-launch-")


@pytest.fixture(scope="module", autouse=True)
def _clean() -> Any:
    yield
    _cleanup()


def _wait_for(path: Path, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _launches(rank: int, world_size: int, root: str, ports: list[int], meet: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
    from gemini_dcp.errors import JobConflictError
    from gemini_dcp.transport import launch
    from gemini_dcp.transport.comm import reset_groups

    pair, r = divmod(rank, 2)
    meet_dir = Path(meet)

    def new_launch(method: str, arg: Any) -> None:
        gc.collect()  # the previous launch's writers (and their launch locks) are gone
        dist.destroy_process_group()
        reset_groups()
        launch.cache_clear()
        if method == "tcp":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{arg}", rank=r, world_size=2)
        elif method == "file":
            dist.init_process_group("gloo", init_method=f"file://{arg}", rank=r, world_size=2)
        elif method == "store":
            dist.init_process_group("gloo", store=dist.FileStore(str(arg), 2), rank=r, world_size=2)
        elif method == "srun":  # what a SLURM script exports by hand, then the env:// rendezvous
            os.environ.update(SLURM_PROCID=str(r), SLURM_NTASKS="2", RANK=str(r), WORLD_SIZE="2",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(arg))
            dist.init_process_group("gloo", init_method="env://")
        else:
            raise AssertionError(method)

    def state(step: int) -> dict[str, torch.Tensor]:
        return {f"w{r}": torch.arange(16, dtype=torch.float32) * (step + 10 * r)}

    def save_and_restore(job: str, w: Any = None) -> str:
        w = w or GeminiStorageWriter(root=root, job_id=job)
        for step in (1, 2):
            dcp.save(state(step), storage_writer=w, checkpoint_id=step)
        out = {f"w{r}": torch.zeros(16)}
        reader = GeminiStorageReader(root=root, job_id=job)
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out[f"w{r}"], state(2)[f"w{r}"]), out
        return w.launch.launch_id

    got: dict[str, Any] = {}
    # ---- two live launches of one job on one root: the second is refused, the first goes on
    new_launch("tcp" if pair == 0 else "file", ports[0] if pair == 0 else meet_dir / "conflict.store")
    if pair == 0:
        w = GeminiStorageWriter(root=root, job_id="shared")
        dcp.save(state(1), storage_writer=w, checkpoint_id=1)
        (meet_dir / f"a-saved-{r}").touch()
        _wait_for(meet_dir / "b-refused-0")
        _wait_for(meet_dir / "b-refused-1")
        dcp.save(state(2), storage_writer=w, checkpoint_id=2)
        out = {f"w{r}": torch.zeros(16)}
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="shared"))
        assert torch.equal(out[f"w{r}"], state(2)[f"w{r}"])
        got["first_kept"] = True
        del w
    else:
        _wait_for(meet_dir / "a-saved-0")
        _wait_for(meet_dir / "a-saved-1")
        try:
            GeminiStorageWriter(root=root, job_id="shared")
        except JobConflictError as exc:
            got["refused"] = str(exc)
        (meet_dir / f"b-refused-{r}").touch()
    # ---- each pair: two more launches, each initialized another way
    methods = [("tcp", ports[1]), ("store", meet_dir / "store-0")] if pair == 0 else [
        ("file", meet_dir / "file-1"), ("srun", ports[2])]
    for method, arg in methods:
        new_launch(method, arg)
        got[method] = save_and_restore(f"by-{method}")
    # a writer built before init_process_group holds its process's launch, then moves to the agreed one
    gc.collect()
    dist.destroy_process_group()
    reset_groups()
    launch.cache_clear()
    early = GeminiStorageWriter(root=root, job_id=f"early-{pair}")
    if pair == 0:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[3]}", rank=r, world_size=2)
    else:
        dist.init_process_group("gloo", init_method=f"file://{meet_dir / 'early'}", rank=r, world_size=2)
    got["early"] = save_and_restore(f"early-{pair}", early)
    assert os.listdir(Path(root, f"early-{pair}", "launches")) == [f"{got['early']}.lock"]
    return got


def test_every_launch_method_is_one_launch_and_two_live_launches_conflict(tmp_path: Path) -> None:
    (root,) = make_roots(1)
    ports = [free_port() for _ in range(4)]
    out = run_ranks(_launches, 4, root, timeout=300, ports=ports, meet=str(tmp_path))
    assert out[0]["first_kept"] and out[1]["first_kept"]
    for r in (2, 3):
        assert "in use by another live launch" in out[r]["refused"], out[r]
    ids = {}
    for pair, methods in ((0, ("tcp", "store")), (1, ("file", "srun"))):
        a, b = out[2 * pair], out[2 * pair + 1]
        for m in methods:
            assert a[m] == b[m], (m, a, b)  # both ranks of the launch agree
            ids[m] = a[m]
    assert len(set(ids.values())) == 4, ids  # every launch its own
    assert out[0]["early"] == out[1]["early"] and out[2]["early"] == out[3]["early"] != out[0]["early"]
