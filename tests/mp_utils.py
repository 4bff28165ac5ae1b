"""Run real multi-process gloo groups for tests: each rank a fresh process.

The ranks are started by a fork server that imported torch once (``forkserver`` with torch
preloaded): a ``spawn`` start re-imports torch in every rank, ~2 s of CPU each, which over the
suite's ~1,000 rank starts was most of its time on a 2-core CI host. Each rank still gets the
parent's current environment and working directory (the fork server's are the ones it was
started with), and nothing of gemini_dcp is preloaded, so module state is never inherited.
``GEMINI_TEST_START_METHOD=spawn`` restores the old start.

``run_ranks(fn, world_size, roots, **kw)`` starts ``world_size`` processes with
torch.distributed initialized over gloo (TCP on 127.0.0.1), calls
``fn(rank, world_size, root, **kw)`` in each, and returns the list of their
return values (pickled through a result file). ``roots[r]`` is the tier root
of rank r: ranks sharing a root form one simulated node.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHOD = os.environ.get("GEMINI_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    # torch and its distributed checkpointing, not gemini_dcp: nothing whose import reads our
    # settings or starts threads.
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint"])


def _entry(rank: int, fn: Callable[..., Any], world_size: int, roots: list[str], port: int, out_dir: str,
           kw: dict[str, Any], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    if env is not None:  # a fork server's child has the server's environment: take the test's
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = ("ok", fn(rank, world_size, roots[rank], **kw))
            Path(out_dir, f"{rank}.returned").touch()  # for the timeout message: a hang in teardown
        finally:
            # A caught DCP error leaves reference cycles (traceback <-> frames) that hold
            # process-group objects; collected only at interpreter exit, their C++ teardown
            # can abort the process ("terminate called without an active exception").
            gc.collect()
            # torch 2.7's gloo worker threads drop their last reference to a finished collective's
            # tensors after completing it, under the group's lock, and need the GIL for that; a
            # destroy_process_group() that starts meanwhile waits for the lock while holding the
            # GIL: a deadlock (seen twice in ~1,600 rank runs, after DTensor.full_tensor()).
            # Releasing the GIL briefly first lets the workers finish.
            time.sleep(0.05)
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent test
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def _start(fn: Callable[..., Any], world_size: int, roots: list[str] | str, out_dir: str, kw: dict[str, Any]) -> Any:
    if isinstance(roots, str):
        roots = [roots] * world_size
    return mp.start_processes(
        _entry, args=(fn, world_size, list(roots), free_port(), out_dir, kw, dict(os.environ), os.getcwd()),
        nprocs=world_size, join=False, start_method=START_METHOD,
    )


def run_ranks(fn: Callable[..., Any], world_size: int, roots: list[str] | str, timeout: float = 240, **kw: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _start(fn, world_size, roots, out_dir, kw)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                returned = [r for r in range(world_size) if Path(out_dir, f"{r}.returned").exists()]
                raise TimeoutError(
                    f"ranks did not finish in {timeout}s; ranks {returned} had returned from {fn.__name__} "
                    "(a rank listed here hung in gc or destroy_process_group)"
                )
        results, failed = [], []
        for r in range(world_size):
            status, value = pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes())
            if status != "ok":
                failed.append(f"rank {r} failed:\n{value}")
            results.append(value)
        if failed:  # every failing rank: the first to fail is often not rank 0
            raise AssertionError("\n\n".join(failed))
        return results


def run_until_death(fn: Callable[..., Any], world_size: int, roots: list[str] | str, timeout: float = 180, **kw: Any) -> list[int | None]:
    """Start ranks like run_ranks; as soon as one dies (e.g. SIGKILLs itself), SIGKILL the rest.

    This is what torchrun does to a worker group when one worker fails. Returns exit codes.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _start(fn, world_size, roots, out_dir, kw)
        deadline = time.monotonic() + timeout
        while all(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join()
        return [p.exitcode for p in ctx.processes]


def node_root_factory(prefix: str) -> tuple[Callable[[int], list[str]], Callable[[], None]]:
    """``make(n)`` -> n fresh tier roots (simulated nodes, on /dev/shm when writable) and ``cleanup()``."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    made: list[str] = []

    def make(n: int) -> list[str]:
        roots = [tempfile.mkdtemp(prefix=f"{prefix}{i}-", dir=base) for i in range(n)]
        made.extend(roots)
        return roots

    def cleanup() -> None:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)

    return make, cleanup


def wipe(root: str) -> None:
    """A replaced machine: its tier root comes back empty."""
    shutil.rmtree(root)
    os.mkdir(root)

