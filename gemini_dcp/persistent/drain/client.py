"""The trainer's side of the drain: requesting a step's upload, making sure a server runs, waiting for durability.

:class:`Drainer` (held by the writer) writes a :class:`~.request.DrainRequest` for every
``persist_every``-th committed step from the node leader (a file write, nothing else on the
training path), and starts a server (:func:`ensure_server`): a detached process
``python -m gemini_dcp.persistent.drain.server`` in its own session (a kill of the worker
group does not reach it), or a thread for ``memory://`` stores. The server gets the
writer's validated :class:`~gemini_dcp.options.DrainOptions` on its command line. The
request holds the slots it names (:mod:`gemini_dcp.local.slot_holds`): the server reads them
in place. :func:`wait_durable` (``GeminiStorageWriter.wait_persisted``) blocks, bounded, until
a step's ``.metadata`` is committed in the store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import PersistentTierError
from ...local.record_codec import write_record
from ...local.record_types import StepRecord
from ...local.slot_holds import take_holds
from ...options.persistent import DrainOptions
from ..store_calls import PersistentTimeoutError
from .lock import lock_free, try_flock
from .paths import Paths, private_dir, write_atomic
from .request import DrainConfig, DrainRequest, SlotRef, StoreTarget
from .server import lower_priority, serve
from .status import step_states, wait_idle

__all__ = ["DEFAULT_WAIT_S", "SERVER_MODULE", "Drainer", "ensure_server", "server_command", "wait_durable", "write_request"]

SERVER_MODULE = "gemini_dcp.persistent.drain.server"
DEFAULT_WAIT_S = 300.0  # wait_persisted's bound when the store has no timeout of its own
DUE_KEEP = 64  # saves whose (fingerprint, timeline) a Drainer remembers for wait_persisted

_THREADS: dict[str, threading.Thread] = {}
_THREADS_LOCK = threading.Lock()


class Drainer:
    """Schedules drains of committed steps from the writer (``_after_commit``); never blocks training.

    ``options`` None: :meth:`DrainOptions.from_env` (validated here, before anything is written).
    ``keep``: the memory tier's ``keep``. With ``keep >= 2`` a request holds its slots and the
    drain reads them in place; with ``keep=1`` (two slots, one always protected) the server
    copies them first, as a held slot could not be spared.
    """

    def __init__(self, tier: Any, persistent: Any, every: int, mode: str | None = None,
                 options: DrainOptions | None = None, keep: int = 2) -> None:
        self.options = DrainOptions.from_env() if options is None else options
        self.tier = tier
        self.persistent = persistent
        self.every = every
        self.paths = Paths(tier.layout.persist_dir)
        self.mode = mode or self.options.resolved_mode(persistent.protocol)
        self.last_due: int | None = None
        # step -> (fingerprint, timeline) of the saves this process submitted as due: what wait_persisted waits for
        self.due_saves: dict[int, tuple[str, str]] = {}
        self.hold = keep >= 2
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
        self.last_due = record.step  # on every rank: what wait_persisted() waits for by default
        self.due_saves[record.step] = (record.fingerprint(), record.timeline)  # this save, not another of its number
        for old in sorted(self.due_saves)[:-DUE_KEEP]:
            del self.due_saves[old]
        own = record.ranks_of(record.node_id)
        if not own or rank != min(own):
            return False
        mine = [s for s in record.slots if s.rank in own]
        slots = tuple(SlotRef(rank=s.rank, path=str(self.tier.slot_path(s.rank, s.slot)), nbytes=int(s.nbytes)) for s in mine)
        # The drain reads these slots in place: the slot choice leaves them alone until it is done.
        holds = take_holds(self.paths.dir, record.step, [(s.rank, s.slot) for s in mine]) if self.hold else []
        rank0_node = bool(record.rank_nodes and record.rank_nodes[0] == record.node_id)
        write_request(self.paths, self.tier, record, slots, self.store, rank0_node=rank0_node,
                      holds=tuple(str(h) for h in holds))
        ensure_server(self.paths.dir, self.mode, options=self.options, bridge=self.options.bridge)
        return True

    def start_early(self) -> None:
        """Start this node's drain server now (at writer construction), off the save path: the
        first due step then finds it running with its upload side imported. Any rank may call it;
        one server per node runs (the others exit at the lock)."""
        if self.mode == "process":
            ensure_server(self.paths.dir, self.mode, options=self.options, warm_first=self.options.bridge)
            if self.options.bridge:  # a bridge in this process finds its upload side imported
                threading.Thread(target=_import_upload_side, name="gemini-dcp-drain-preload", daemon=True).start()

    def wait_persisted(self, step: int | None = None, timeout_s: float | None = None, poll_s: float = 0.02) -> int | None:
        """Block until ``step`` (default: the newest step this process submitted as due) is durable.

        See :meth:`gemini_dcp.GeminiStorageWriter.wait_persisted`; the logic lives in
        :func:`wait_durable`. Returns the newest durable step of the store.
        """
        target = self.last_due if step is None else int(step)
        limit = float(self.store.timeout_s or DEFAULT_WAIT_S) if timeout_s is None else float(timeout_s)
        expect = None if target is None else self.due_saves.get(target)
        if expect is None and target is not None:  # not submitted by this process: the save this node holds
            rec = self.tier.record(target)
            if rec is not None:
                expect = (rec.fingerprint(), rec.timeline)
        return wait_durable(self.paths, self.persistent, target, limit, poll_s=poll_s, revive=self.ensure_server,
                            expect=expect)

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


def _import_upload_side() -> None:
    from . import upload  # noqa: F401, PLC0415 - torch is here already: only the module's own imports


def wait_durable(
    paths: Paths, store: Any, step: int | None, timeout_s: float, *, poll_s: float = 0.02,
    revive: Callable[[], None] | None = None, expect: tuple[str, str] | None = None,
) -> int | None:
    """Wait until ``step`` (or a newer step that superseded it in the drain) is durable in ``store``.

    Durable: ``.metadata`` committed, seen in this node's drain status (the committing node) or
    in the store (any node). ``expect``, ``(fingerprint, timeline)`` of the save waited for, makes
    it *this save* of the step: after a rollback the abandoned timeline's drain of the same step
    number, or its newer steps, never count (a newer step counts only when the store's history,
    :mod:`gemini_dcp.core.timelines`, keeps this save's timeline at ``step``). Returns the newest
    live committed step of the store (``step`` None: at once, nothing is waited for). Raises
    :class:`PersistentTierError` with the drain's reason when the step's drain failed for good,
    and :class:`PersistentTimeoutError` (a ``PersistentTierError``) after ``timeout_s``, with the
    last failed attempt if any. ``revive`` (the server start) is called now and then while the
    step's request is pending, so a drain server that died meanwhile is replaced.
    """
    if step is None:
        return _newest_durable(store)
    deadline = time.monotonic() + timeout_s
    watch = step
    fingerprint, timeline = expect if expect is not None else (None, None)
    store_every = 0.1 if getattr(store, "is_local", False) or getattr(store, "protocol", "") == "memory" else 1.0
    next_store = next_revive = 0.0
    last_failure: str | None = None
    while True:
        st = step_states(paths.dir).get(watch)
        if st is not None and fingerprint is not None and st.fingerprint != fingerprint:
            st = None  # the status of another save of this step number (an abandoned timeline's)
        if st is not None:
            if st.superseded_by is not None and st.superseded_by > watch:
                watch, fingerprint = st.superseded_by, None  # a newer save of the same timeline
                continue
            if st.state == "durable":
                newest = _newest_durable(store, timeline)
                return watch if newest is None else max(newest, watch)
            if st.state == "failed":
                if not st.retrying:
                    raise PersistentTierError(
                        f"step {watch}: its drain to the persistent tier {store.url} failed: {st.reason}. It will not be "
                        f"retried; the step stays in memory. See {paths.log} and `gemini-dcp inspect`; save again to "
                        "drain a newer step."
                    )
                last_failure = st.reason
        now = time.monotonic()
        if now >= next_store:
            next_store = now + store_every
            done = _durable_in_store(store, watch, fingerprint, timeline)
            if done is not None:
                return done
        if now >= deadline:
            tail = f" The last attempt failed: {last_failure}." if last_failure else ""
            raise PersistentTimeoutError(
                f"step {watch} was not durable in the persistent tier {store.url} within {timeout_s:g} s "
                f"(its drain is {st.state if st is not None else 'not requested on this node'}).{tail} Pass a larger "
                f"timeout_s, or see {paths.log} and `gemini-dcp inspect`."
            )
        if revive is not None and now >= next_revive and watch in paths.pending():
            next_revive = now + 1.0
            revive()
        time.sleep(min(poll_s, max(0.0, deadline - now)))


def _durable_in_store(store: Any, step: int, fingerprint: str | None, timeline: str | None) -> int | None:
    """The newest live committed step of ``store`` when the save waited for is durable there, else None:
    ``step`` committed from the save with ``fingerprint``, or (no fingerprint known) a live step at or
    after ``step`` while the store's history keeps ``timeline`` at ``step``."""
    steps = store.committed_steps()
    if timeline is None:  # nothing known of the save: any step at or after it, as before timelines
        return max(steps) if steps and max(steps) >= step else None
    live = store.live_steps(steps)
    if fingerprint is not None and step in steps:
        index = store.read_index(step)
        if index is not None and index.fingerprint == fingerprint:
            return max(live, default=step)
    if fingerprint is None or step not in steps:
        _, lineage = store.timelines(steps)
        if lineage.live(step, timeline) and any(s >= step for s in live):
            return max(live)
    return None


def _newest_durable(store: Any, timeline: str | None = None) -> int | None:
    steps = store.committed_steps()
    if timeline is not None and hasattr(store, "live_steps"):
        steps = store.live_steps(steps)
    return max(steps) if steps else None


def write_request(
    p: Paths, tier: Any, record: StepRecord, slots: tuple[SlotRef, ...], store: StoreTarget, *,
    rank0_node: bool = False, adopted_from: tuple[str, ...] = (), holds: tuple[str, ...] = (),
) -> DrainRequest:
    """Write the drain request of ``record``'s step into ``p`` (staging dir, record snapshot, request).

    ``slots`` are the bytes to upload; ``store`` where to; ``rank0_node`` / ``adopted_from``
    the request's role; ``holds`` the slot holds taken for it (see :class:`DrainRequest`).
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
        adopted_from=tuple(adopted_from), created_unix=time.time(), holds=tuple(holds),
    )
    write_atomic(p.request(record.step), req.to_json().encode())
    return req


def ensure_server(
    persist_dir: str | os.PathLike[str], mode: str = "process", *, standby: bool = False,
    options: DrainOptions | None = None, bridge: bool = False, warm_first: bool = False,
) -> None:
    """Start a drain server for ``persist_dir`` unless one holds its lock.

    With ``standby=True`` (process mode), a held lock still gets a standby server: it waits
    for the lock while requests are pending, for a holder that is dying rather than serving.
    ``warm_first`` (the writer, when it is built): the process imports its upload side before
    it takes the lock (:func:`~.server.warm_then_serve`). ``bridge`` (a request was just written):
    while such a process still imports, serve in a thread of this process (it has torch) until
    that process is warm, so the first due step does not wait for the import.
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
    warming = mode == "process" and not lock_free(p.warming_lock, p.dir)
    if warming and not bridge:
        return  # a server is starting; it takes the lock once warm
    if mode == "thread" or warming:
        key = str(p.dir)
        with _THREADS_LOCK:
            t = _THREADS.get(key)
            if warming and t is not None and t.is_alive():
                return  # our bridge serves already (it may be between the lock and its loop)
            t = threading.Thread(target=serve, args=(str(p.dir),),
                                 kwargs={"options": opts, "idle_s": 0.0, "bridge": warming},
                                 name="gemini-dcp-drain-bridge" if warming else "gemini-dcp-drain", daemon=False)
            _THREADS[key] = t
            t.start()
        return
    _spawn(p, opts, warm_first=warm_first)


def server_command(persist_dir: str | os.PathLike[str], options: DrainOptions, *, standby: bool = False,
                   warm_first: bool = False, warming_fd: int | None = None, starting_fd: int | None = None) -> list[str]:
    """The command line of a detached drain server (started by module name)."""
    return [sys.executable, "-m", SERVER_MODULE, str(persist_dir), "--options", options.to_json(),
            "--base-nice", str(os.getpriority(os.PRIO_PROCESS, 0))] + (
        ["--standby"] if standby else []
    ) + (["--warm-first"] if warm_first else []) + (["--warming-fd", str(warming_fd)] if warming_fd is not None else []) + (
        ["--starting-fd", str(starting_fd)] if starting_fd is not None else [])


def _spawn(p: Paths, options: DrainOptions, *, standby: bool = False, warm_first: bool = False) -> None:
    """Start a detached drain process (own session: a kill of the worker group does not reach it)."""
    pkg_parent = str(Path(__file__).resolve().parents[3])  # this copy of gemini_dcp, whatever the cwd
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # A warming server's lock is taken here and handed to it (the same open file: the lock goes with
    # it), so a request this process writes right after already finds the server warming.
    wfd = sfd = None
    if warm_first:
        wfd = os.open(p.warming_lock, os.O_RDWR | os.O_CREAT, 0o600)
        if not try_flock(wfd):
            os.close(wfd)
            return  # another server warms
    elif not standby:
        # A plain server is started by whichever call finds daemon.lock free (a due step, a wait_persisted()
        # poll of every rank each second): until the process holds that lock (seconds on a loaded host) it
        # holds starting.lock, so those calls do not start a process each. It serves every pending request.
        sfd = os.open(p.starting_lock, os.O_RDWR | os.O_CREAT, 0o600)
        if not try_flock(sfd):
            os.close(sfd)
            return  # a server is starting
    try:
        with open(p.log, "ab") as logf:
            proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                server_command(p.dir, options, standby=standby, warm_first=warm_first, warming_fd=wfd, starting_fd=sfd),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(fd for fd in (wfd, sfd) if fd is not None),
                env=env,
                cwd="/",
            )
    finally:
        for fd in (wfd, sfd):
            if fd is not None:
                os.close(fd)  # the server holds the lock now (or, if it did not start, nobody does)
    # Its own start-up (the interpreter, then torch) runs below training from the first instruction on.
    lower_priority(options.nice, pid=proc.pid)
    if warm_first:
        write_atomic(p.pid, str(proc.pid).encode())  # the node's drain process from now on (a bridge never is)
