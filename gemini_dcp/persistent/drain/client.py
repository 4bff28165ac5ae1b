"""The trainer's side of the drain: requesting a step's upload and making sure a server runs.

:class:`Drainer` (held by the writer) writes a :class:`~.request.DrainRequest` for every
``persist_every``-th committed step from the node leader (~1 ms, nothing else on the
training path), and starts a server (:func:`ensure_server`): a detached process
``python -m gemini_dcp.persistent.drain.server`` in its own session (a kill of the worker
group does not reach it), or a thread for ``memory://`` stores. The server gets the
writer's validated :class:`~gemini_dcp.options.DrainOptions` on its command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...local.records import StepRecord, write_record
from ...options.persistent import DrainOptions
from .lock import lock_free
from .paths import Paths, private_dir, write_atomic
from .request import DrainConfig, DrainRequest, SlotRef, StoreTarget
from .server import serve
from .status import wait_idle

__all__ = ["SERVER_MODULE", "Drainer", "ensure_server", "server_command", "write_request"]

SERVER_MODULE = "gemini_dcp.persistent.drain.server"

_THREADS: dict[str, threading.Thread] = {}
_THREADS_LOCK = threading.Lock()


class Drainer:
    """Schedules drains of committed steps from the writer (``_after_commit``); never blocks training.

    ``options`` None: :meth:`DrainOptions.from_env` (validated here, before anything is written).
    """

    def __init__(self, tier: Any, persistent: Any, every: int, mode: str | None = None,
                 options: DrainOptions | None = None) -> None:
        self.options = DrainOptions.from_env() if options is None else options
        self.tier = tier
        self.persistent = persistent
        self.every = every
        self.paths = Paths(tier.layout.persist_dir)
        self.mode = mode or self.options.resolved_mode(persistent.protocol)
        self.store = StoreTarget(
            url=persistent.url, job_id=persistent.job_id, keep=persistent.keep, keep_every=persistent.keep_every,
            timeout_s=persistent.timeout_s,
        )
        self._write_config()

    def _write_config(self) -> None:
        """Record this job's drain settings on the node's tmpfs: a restore after a node loss reads
        them to upload the lost node's part of a pending step (``gemini_dcp.persistent.adopt``)."""
        cfg = DrainConfig(store=self.store, every=self.every, mode=self.mode, protocol=self.persistent.protocol,
                          drain=self.options)
        data = cfg.to_json().encode()
        try:
            if self.paths.config.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        private_dir(self.paths.dir)
        write_atomic(self.paths.config, data)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def restage(self, record: StepRecord) -> None:
        """Replace the staged record of a requested drain by ``record``, its completed form.

        The coordinator completes a record in ``finish`` when the planner did not expose its
        metadata during the write; without this the drain would find the complete form only
        in the tier, which a later save may have evicted by the time a restarted drain resumes.
        """
        stage = self.paths.stage(record.step) / "record.rec"
        if not stage.exists():
            return
        write_record(stage, record)  # atomic: written beside, renamed over the staged copy

    def submit(self, record: StepRecord, rank: int) -> bool:
        """Request a drain of ``record``'s step from this node; True if one was requested.

        Only the node leader (lowest rank on the node) requests, and only for
        steps that are multiples of ``persist_every``.
        """
        if not self.due(record.step):
            return False
        own = record.ranks_of(record.node_id)
        if not own or rank != min(own):
            return False
        slots = tuple(
            SlotRef(rank=s.rank, path=str(self.tier.slot_path(s.rank, s.slot)), nbytes=int(s.nbytes))
            for s in record.slots if s.rank in own
        )
        rank0_node = bool(record.rank_nodes and record.rank_nodes[0] == record.node_id)
        write_request(self.paths, self.tier, record, slots, self.store, rank0_node=rank0_node)
        self.ensure_server()
        return True

    def resume(self) -> None:
        """Start a server for requests left by a previous worker generation (after a restart).

        The previous generation's server may have been killed with the workers and still hold
        its lock while the kernel tears it down: then a standby server waits for the lock.
        """
        for p in (self.paths, self.paths.adopt):
            if p.pending():
                ensure_server(p.dir, self.mode, standby=True, options=self.options)

    def ensure_server(self) -> None:
        ensure_server(self.paths.dir, self.mode, options=self.options)

    def wait(self, timeout_s: float = 300.0) -> bool:
        return wait_idle(self.paths.dir, timeout_s)


def write_request(
    p: Paths, tier: Any, record: StepRecord, slots: tuple[SlotRef, ...], store: StoreTarget, *,
    rank0_node: bool = False, adopted_from: tuple[str, ...] = (),
) -> DrainRequest:
    """Write the drain request of ``record``'s step into ``p`` (staging dir, record snapshot, request).

    ``slots`` are the bytes to upload; ``store`` where to; ``rank0_node`` / ``adopted_from``
    the request's role (see :class:`DrainRequest`).
    """
    private_dir(p.requests)
    stage = p.stage(record.step)
    if stage.exists():  # a leftover of an older save of the same step number (abandoned timeline)
        shutil.rmtree(stage, ignore_errors=True)
    private_dir(stage)
    src = tier.layout.record_path(record.step)
    try:
        os.link(src, stage / "record.rec")  # records are renamed into place, never edited: a link is a snapshot
    except OSError:
        write_record(stage / "record.rec", record)
    req = DrainRequest(
        step=record.step, root=str(tier.root), record_path=str(src), node_id=record.node_id,
        fingerprint=record.fingerprint(), slots=tuple(slots), store=store, rank0_node=rank0_node,
        adopted_from=tuple(adopted_from), created_unix=time.time(),
    )
    write_atomic(p.request(record.step), req.to_json().encode())
    return req


def ensure_server(
    persist_dir: str | os.PathLike[str], mode: str = "process", *, standby: bool = False,
    options: DrainOptions | None = None,
) -> None:
    """Start a drain server for ``persist_dir`` unless one holds its lock.

    With ``standby=True`` (process mode), a held lock still gets a standby server: it waits
    for the lock while requests are pending, for a holder that is dying rather than serving.
    ``options`` None: :meth:`DrainOptions.from_env`.
    """
    opts = DrainOptions.from_env() if options is None else options
    p = Paths(persist_dir)
    # The lock, not the liveness of a thread or process, says whether a server will see new requests:
    # a server that is about to exit drops the lock first and then looks for requests once more.
    if not lock_free(p.lock, p.dir):
        if standby and mode == "process" and lock_free(p.standby_lock, p.dir):
            _spawn(p, opts, standby=True)
        return
    if mode == "thread":
        key = str(p.dir)
        with _THREADS_LOCK:
            t = threading.Thread(target=serve, args=(str(p.dir),), kwargs={"options": opts, "idle_s": 0.0},
                                 name="gemini-dcp-drain", daemon=False)
            _THREADS[key] = t
            t.start()
        return
    _spawn(p, opts)


def server_command(persist_dir: str | os.PathLike[str], options: DrainOptions, *, standby: bool = False) -> list[str]:
    """The command line of a detached drain server (started by module name)."""
    return [sys.executable, "-m", SERVER_MODULE, str(persist_dir), "--options", options.to_json()] + (
        ["--standby"] if standby else []
    )


def _spawn(p: Paths, options: DrainOptions, *, standby: bool = False) -> None:
    """Start a detached drain process (own session: a kill of the worker group does not reach it)."""
    pkg_parent = str(Path(__file__).resolve().parents[3])  # this copy of gemini_dcp, whatever the cwd
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(p.log, "ab") as logf:
        subprocess.Popen(  # noqa: S603 - our own interpreter and module
            server_command(p.dir, options, standby=standby),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd="/",
        )
