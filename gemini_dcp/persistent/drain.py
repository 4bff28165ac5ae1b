"""Background drain of committed steps from node memory to the persistent tier.

How a step gets from CPU memory to the store (per node, no funnel through rank 0):

1. **Request** (training path, ~1 ms): once a step is committed in memory, the
   node's leader rank (its lowest rank) writes ``persist/requests/step-N.json``
   on the node's tmpfs (the slots of the saving ranks that *ran on this node*),
   hard-links the step record next to it, and makes sure a drain server runs.
   Nothing else happens in the training process.
2. **Stage** (server, at once): the server copies those slot bytes into
   ``persist/stage/step-N/`` on the same tmpfs (``copy_file_range``), so the
   memory tier may reuse the slots for newer steps while the upload runs.
   This part imports nothing heavy, so it starts within ~0.1 s.
3. **Upload**: each item is verified against its saved checksum, then written
   as ``torch.save`` bytes into ``__<rank>_0.distcp`` in the store (progress is
   recorded per rank, so a killed server resumes where it stopped). Then the
   node writes its part marker ``.gemini/part-<node>.pkl``.
4. **Commit**: a node that finds every item of the step covered by the
   markers writes ``.metadata`` (last); the node of saving rank 0 also polls
   for late parts. Then retention runs.

The server is a **detached process** (``start_new_session=True``): torchrun
killing the worker group does not stop it, and it shares no GIL with training.
It holds an ``flock`` on ``persist/daemon.lock`` (one per node and job), exits
after ``$GEMINI_DCP_DRAIN_IDLE_S`` (60 s) with nothing to do, and is started
again by the next request or by a writer constructed after a restart (which
resumes any request left on tmpfs). A SIGKILLed server holds its lock until the
kernel has closed its files, which can outlast a worker restart: a writer that
resumes pending requests while the lock is held starts a *standby* server
(at most one, ``persist/standby.lock``) that waits for the lock and serves as
soon as it is free, or exits once no request is pending. ``memory://`` stores live inside one
process, so for them (or with ``GEMINI_DCP_DRAIN_MODE=thread``) the server is a
thread of the training process instead.

If a drain is slower than the save cadence, a newer request supersedes an
older one that has not started uploading (coalescing): the store gets the
newest step possible instead of falling ever further behind.

This module must stay importable without torch (the server stages before it
imports torch); torch-dependent code is imported inside functions.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("gemini_dcp.persistent.drain")

ENV_MODE = "GEMINI_DCP_DRAIN_MODE"  # "process" (default) or "thread"
ENV_IDLE = "GEMINI_DCP_DRAIN_IDLE_S"  # a drain server exits after this many idle seconds (default 60)
ENV_THROTTLE = "GEMINI_DCP_DRAIN_THROTTLE_BPS"  # cap on upload bytes/s (tests; shared links)
ENV_PEER_TIMEOUT = "GEMINI_DCP_DRAIN_PEER_TIMEOUT_S"  # rank 0's node waits this long for other parts (3600)
ENV_NICE = "GEMINI_DCP_DRAIN_NICE"  # niceness of the drain process (default 10: training first), or "idle"
ENV_THREADS = "GEMINI_DCP_DRAIN_THREADS"  # files written in parallel per node (default 2)
ENV_ATTEMPTS = "GEMINI_DCP_DRAIN_ATTEMPTS"  # upload attempts of a step before it is abandoned (default 5)

POLL_S = 0.05
STANDBY_POLL_S = 0.1
STANDBY_S = 600.0  # a standby server gives up waiting for the lock after this long
AWAIT_POLL_S = 0.5
MAX_ATTEMPTS = 5
SPLIT_BYTES = 64 << 20  # a rank with more than this is written as several files in parallel
STATUS_KEEP = 64

_THREADS: dict[str, threading.Thread] = {}
_THREADS_LOCK = threading.Lock()


def _name(step: int) -> str:
    return f"step-{step:012d}"


class Paths:
    """Drain state of one job on one node: ``<tier root>/<job_id>/persist/``."""

    def __init__(self, persist_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(persist_dir)
        self.requests = self.dir / "requests"
        self.stage_root = self.dir / "stage"
        self.lock = self.dir / "daemon.lock"
        self.standby_lock = self.dir / "standby.lock"
        self.pid = self.dir / "daemon.pid"
        self.status = self.dir / "status.json"
        self.log = self.dir / "drain.log"
        self.config = self.dir / "config.json"

    @property
    def adopt(self) -> "Paths":
        """The drain state of adopted parts (a lost node's ranks, uploaded from the replicas held here).

        Kept apart from the node's own requests (which are keyed by step alone) and served by
        a server of its own, so an adoption never waits behind, or blocks, the node's own drain.
        """
        return Paths(self.dir / "adopt")

    def request(self, step: int) -> Path:
        return self.requests / f"{_name(step)}.json"

    def stage(self, step: int) -> Path:
        return self.stage_root / _name(step)

    def pending(self) -> list[int]:
        try:
            names = os.listdir(self.requests)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if n.startswith("step-") and n.endswith(".json"):
                try:
                    out.append(int(n[5:-5]))
                except ValueError:
                    continue
        return sorted(out)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


# ---- worker side -----------------------------------------------------------------------------------
class Drainer:
    """Schedules drains of committed steps from the writer (``_after_commit``); never blocks training."""

    def __init__(self, tier: Any, persistent: Any, every: int, mode: str | None = None) -> None:
        self.tier = tier
        self.persistent = persistent
        self.every = every
        self.paths = Paths(tier.layout.persist_dir)
        env_mode = os.environ.get(ENV_MODE, "").strip().lower()
        self.mode = mode or env_mode or ("thread" if persistent.protocol == "memory" else "process")
        if self.mode not in ("process", "thread"):
            from ..errors import ConfigError  # noqa: PLC0415

            raise ConfigError(f"{ENV_MODE}={self.mode!r}: choose 'process' (default) or 'thread'.")
        self.store = {
            "url": persistent.url, "job_id": persistent.job_id, "keep": persistent.keep, "keep_every": persistent.keep_every,
            "timeout_s": persistent.timeout_s,
        }
        self._write_config()

    def _write_config(self) -> None:
        """Record this job's drain settings on the node's tmpfs: a restore after a node loss reads
        them to upload the lost node's part of a pending step (``gemini_dcp.persistent.adopt``)."""
        cfg = {"version": 1, **self.store, "every": self.every, "mode": self.mode, "protocol": self.persistent.protocol}
        data = json.dumps(cfg, sort_keys=True).encode()
        try:
            if self.paths.config.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        _private_dir(self.paths.dir)
        _write_atomic(self.paths.config, data)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def restage(self, record: Any) -> None:
        """Replace the staged record of a requested drain by ``record``, its completed form.

        The coordinator completes a record in ``finish`` when the planner did not expose its
        metadata during the write; without this the drain would find the complete form only
        in the tier, which a later save may have evicted by the time a restarted drain resumes.
        """
        stage = self.paths.stage(record.step) / "record.rec"
        if not stage.exists():
            return
        from ..local.records import write_record  # noqa: PLC0415

        write_record(stage, record)  # atomic: written beside, renamed over the staged copy

    def submit(self, record: Any, rank: int) -> bool:
        """Request a drain of ``record``'s step from this node; True if one was requested.

        Only the node leader (lowest rank on the node) requests, and only for
        steps that are multiples of ``persist_every``.
        """
        if not self.due(record.step):
            return False
        own = record.ranks_of(record.node_id)
        if not own or rank != min(own):
            return False
        slots = [
            [s.rank, str(self.tier.slot_path(s.rank, s.slot)), int(s.nbytes)] for s in record.slots if s.rank in own
        ]
        rank0_node = bool(record.rank_nodes and record.rank_nodes[0] == record.node_id)
        write_request(self.paths, self.tier, record, slots, {**self.store, "rank0_node": rank0_node})
        self.ensure_server()
        return True

    def resume(self) -> None:
        """Start a server for requests left by a previous worker generation (after a restart).

        The previous generation's server may have been killed with the workers and still hold
        its lock while the kernel tears it down: then a standby server waits for the lock.
        """
        for p in (self.paths, self.paths.adopt):
            if p.pending():
                ensure_server(p.dir, self.mode, standby=True)

    def ensure_server(self) -> None:
        ensure_server(self.paths.dir, self.mode)

    def wait(self, timeout_s: float = 300.0) -> bool:
        return wait_idle(self.paths.dir, timeout_s)


def write_request(p: Paths, tier: Any, record: Any, slots: list[list[Any]], fields: dict[str, Any]) -> None:
    """Write the drain request of ``record``'s step into ``p`` (staging dir, record snapshot, request).

    ``slots`` are ``[rank, slot path, nbytes]`` of the bytes to upload; ``fields`` carry the
    store (``url``, ``job_id``, ``keep``, ``keep_every``) and the request's role (``rank0_node``,
    ``adopted_from``).
    """
    _private_dir(p.requests)
    stage = p.stage(record.step)
    if stage.exists():  # a leftover of an older save of the same step number (abandoned timeline)
        shutil.rmtree(stage, ignore_errors=True)
    _private_dir(stage)
    src = tier.layout.record_path(record.step)
    try:
        os.link(src, stage / "record.rec")  # records are renamed into place, never edited: a link is a snapshot
    except OSError:
        from ..local.records import write_record  # noqa: PLC0415

        write_record(stage / "record.rec", record)
    req = {
        "version": 1,
        "step": record.step,
        "root": str(tier.root),
        "record_path": str(src),
        "node_id": record.node_id,
        "fingerprint": record.fingerprint(),
        "slots": slots,
        "created_unix": time.time(),
        **fields,
    }
    _write_atomic(p.request(record.step), json.dumps(req).encode())


STORE_FIELDS = ("url", "job_id", "keep", "keep_every", "timeout_s")  # where a request uploads to (Drainer.store)


def read_config(persist_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The drain settings a writer with a persistent tier left on this node (None if none did)."""
    try:
        cfg = json.loads(Paths(persist_dir).config.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg.get("url") and int(cfg.get("every") or 0) >= 1 else None


def ensure_server(persist_dir: str | os.PathLike[str], mode: str = "process", *, standby: bool = False) -> None:
    """Start a drain server for ``persist_dir`` unless one holds its lock.

    With ``standby=True`` (process mode), a held lock still gets a standby server: it waits
    for the lock while requests are pending, for a holder that is dying rather than serving.
    """
    p = Paths(persist_dir)
    # The lock, not the liveness of a thread or process, says whether a server will see new requests:
    # a server that is about to exit drops the lock first and then looks for requests once more.
    if not _lock_free(p.lock, p.dir):
        if standby and mode == "process" and _lock_free(p.standby_lock, p.dir):
            _spawn(p, standby=True)
        return
    if mode == "thread":
        key = str(p.dir)
        with _THREADS_LOCK:
            t = threading.Thread(target=serve, args=(str(p.dir),), kwargs={"idle_s": 0.0}, name="gemini-dcp-drain", daemon=False)
            _THREADS[key] = t
            t.start()
        return
    _spawn(p)


def _lock_free(lock: Path, parent: Path) -> bool:
    """Whether no process holds ``lock`` (tested by taking and dropping it)."""
    _private_dir(parent)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return _try_flock(fd)
    finally:
        os.close(fd)  # closing drops the lock if we took it


_BOOT = (
    "import sys,importlib.util as u;"
    "s=u.spec_from_file_location('_gemini_dcp_drain',sys.argv[1]);m=u.module_from_spec(s);"
    "sys.modules['_gemini_dcp_drain']=m;s.loader.exec_module(m);m.main(sys.argv[2:])"
)


def _spawn(p: Paths, *, standby: bool = False) -> None:
    """Start a detached drain process (own session: a kill of the worker group does not reach it)."""
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(p.log, "ab") as logf:
        subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-c", _BOOT, str(Path(__file__).resolve()), str(p.dir), pkg_parent]
            + (["--standby"] if standby else []),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd="/",
        )


def wait_idle(persist_dir: str | os.PathLike[str], timeout_s: float = 300.0, poll_s: float = 0.05) -> bool:
    """Wait until this node has no pending drain request (done or abandoned); False on timeout."""
    p = Paths(persist_dir)
    deadline = time.monotonic() + timeout_s
    while p.pending():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def drain_status(persist_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What the drain server of this node reported: ``{"steps": {step: {...}}, "pending": [...]}``."""
    p = Paths(persist_dir)
    try:
        status = json.loads(p.status.read_bytes())
    except (FileNotFoundError, ValueError):
        status = {"steps": {}}
    status["pending"] = p.pending()
    return status


def drain_summary(persist_dir: str | os.PathLike[str], recent: int = 3) -> dict[str, Any] | None:
    """This node's drain of one job, for operators (``gemini-dcp inspect``); reads files only.

    ``{"url", "every", "pending", "recent", "adopt_pending", "adopt_recent"}``: the store and
    cadence a writer configured, the steps waiting, and the last ``recent`` outcomes (``step``,
    ``state``, ``unix``, and ``reason`` / ``detail`` when there is one) of the node's own drain
    and of adopted parts (``gemini_dcp.persistent.adopt``). None when no drain ever ran for the job here.
    """
    p = Paths(persist_dir)
    cfg = read_config(p.dir) or {}
    own, adopt = drain_status(p.dir), drain_status(p.adopt.dir)
    if not cfg and not any(st["steps"] or st["pending"] for st in (own, adopt)):
        return None

    def latest(status: dict[str, Any]) -> list[dict[str, Any]]:
        steps = status.get("steps", {})
        out = []
        for k in sorted(steps, key=int)[-recent:]:
            entry = steps[k]
            out.append({"step": int(k), **{f: entry[f] for f in ("state", "unix", "reason", "detail") if entry.get(f)}})
        return out

    return {
        "url": cfg.get("url"), "every": cfg.get("every"),
        "pending": own["pending"], "recent": latest(own),
        "adopt_pending": adopt["pending"], "adopt_recent": latest(adopt),
    }


def server_pid(persist_dir: str | os.PathLike[str]) -> int | None:
    try:
        return int(Paths(persist_dir).pid.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


# ---- server ------------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    """Entry point of the detached drain process: ``main([persist_dir, package_parent, ["--standby"]])``."""
    persist_dir = argv[0]
    if len(argv) > 1 and argv[1] not in sys.path:
        sys.path.insert(0, argv[1])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s drain[{os.getpid()}] %(levelname)s %(message)s")
    _lower_priority(os.environ.get(ENV_NICE, "10"))
    idle = float(os.environ.get(ENV_IDLE, "60"))
    serve(persist_dir, idle_s=idle, standby_s=STANDBY_S if "--standby" in argv[2:] else 0.0)


def _lower_priority(setting: str) -> None:
    """Training first: ``idle`` (SCHED_IDLE: run only on otherwise idle CPUs) or a nice value."""
    try:
        if setting.strip().lower() == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.nice(int(setting))
    except (OSError, ValueError, AttributeError) as exc:  # the drain still works, at normal priority
        log.warning("drain: could not lower priority to %r (%s); running at normal priority", setting, exc)


def serve(persist_dir: str, *, idle_s: float = 60.0, standby_s: float = 0.0) -> None:
    """Run the drain server of ``persist_dir`` until idle.

    Returns at once if another server holds the lock, unless ``standby_s > 0``: then it waits
    for the lock (up to ``standby_s``) while requests are pending and no other standby waits.
    """
    p = Paths(persist_dir)
    try:
        _private_dir(p.dir)
        fd = os.open(p.lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    if not _take_lock(p, fd, standby_s):
        os.close(fd)
        return
    try:
        _write_atomic(p.pid, str(os.getpid()).encode())
        _Server(p, fd, idle_s).run()
    except Exception:  # noqa: BLE001 - a server error must not escape into a training thread
        log.exception("drain server for %s failed", persist_dir)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def _take_lock(p: Paths, fd: int, standby_s: float) -> bool:
    """Take the server lock on ``fd``; as a standby, wait for it while requests are pending."""
    if _try_flock(fd):
        return True
    if standby_s <= 0:
        return False
    try:
        standby_fd = os.open(p.standby_lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        if not _try_flock(standby_fd):
            return False  # another standby already waits
        log.info("drain lock held by another server; standing by for up to %.0f s", standby_s)
        deadline = time.monotonic() + standby_s
        while p.pending() and time.monotonic() < deadline:
            time.sleep(STANDBY_POLL_S)
            if _try_flock(fd):
                log.info("drain lock taken over from the previous server")
                return True
        return False
    finally:
        os.close(standby_fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class _Server:
    def __init__(self, p: Paths, lock_fd: int, idle_s: float) -> None:
        self.p = p
        self.lock_fd = lock_fd
        self.idle_s = idle_s
        self.status_lock = threading.Lock()
        self.uploading: int | None = None
        self.upload_thread: threading.Thread | None = None
        self.upload_result: tuple[int, str, str] | None = None
        self.awaiting: dict[int, float] = {}  # step -> monotonic time its part was done
        self.attempts: dict[int, int] = {}
        self.retry_at: dict[int, float] = {}
        self.last_await_poll = 0.0
        self.tiers: dict[tuple[str, str], Any] = {}
        self.throttle = float(os.environ.get(ENV_THROTTLE, "0") or 0) or None
        self.threads = max(1, int(os.environ.get(ENV_THREADS, "2") or 2))
        self.peer_timeout = float(os.environ.get(ENV_PEER_TIMEOUT, "3600"))
        self.max_attempts = max(1, int(os.environ.get(ENV_ATTEMPTS, str(MAX_ATTEMPTS)) or MAX_ATTEMPTS))

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        idle_since = time.monotonic()
        while True:
            if not self.p.dir.is_dir():
                log.info("drain state %s is gone; exiting", self.p.dir)
                return
            reqs = self._requests()
            for step, req in reqs.items():
                if step not in self.awaiting and step != self.uploading and not (self.p.stage(step) / "staged").exists():
                    self._stage(req)
            reqs = self._requests()
            self._coalesce(reqs)
            self._reap_upload()
            self._start_upload(self._requests())
            self._poll_awaiting()
            busy = bool(self.p.pending()) or self.upload_thread is not None
            now = time.monotonic()
            if busy:
                idle_since = now
            elif now - idle_since >= self.idle_s:
                if self._release_or_continue():
                    idle_since = time.monotonic()
                    continue
                return
            time.sleep(POLL_S)

    def _release_or_continue(self) -> bool:
        """Drop the lock, then look again: a request written meanwhile is ours if we get the lock back."""
        fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        if not self.p.pending():
            return False
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a new server took over
        return True

    def _requests(self) -> dict[int, dict[str, Any]]:
        out = {}
        for step in self.p.pending():
            try:
                out[step] = json.loads(self.p.request(step).read_bytes())
            except (FileNotFoundError, ValueError):
                continue
        return out

    # -- staging (no torch) -------------------------------------------------------------------
    def _stage(self, req: dict[str, Any]) -> None:
        step = int(req["step"])
        d = self.p.stage(step)
        t0 = time.monotonic()
        try:
            _private_dir(d)
            todo = list(req["slots"])
            need = sum(n for _, _, n in todo)
            st = os.statvfs(d)
            free = st.f_bavail * st.f_frsize
            direct = need > free - (64 << 20)
            if direct:
                log.warning(
                    "step %d: not enough tmpfs for a staging copy (%.3f GiB needed, %.3f free): draining straight "
                    "from the memory slots (fails if a newer save reuses them first)", step, need / 2**30, free / 2**30,
                )
            else:
                for rank, src, n in todo:
                    _copy_prefix(Path(src), d / f"rank-{rank:05d}.bin", n)
            _write_atomic(d / "staged", json.dumps({"direct": direct, "seconds": time.monotonic() - t0}).encode())
            self._set_status(step, "staged", bytes=need, stage_seconds=round(time.monotonic() - t0, 4))
        except FileNotFoundError as exc:
            self._abandon(step, f"its memory slot is gone before it could be staged ({exc})")
        except OSError as exc:
            self._abandon(step, f"staging failed: {exc}")

    def _coalesce(self, reqs: dict[int, dict[str, Any]]) -> None:
        waiting = [
            s for s in reqs
            if s != self.uploading and s not in self.awaiting and (self.p.stage(s) / "staged").exists()
        ]
        if len(waiting) <= 1:
            return
        newest = max(waiting)
        for s in waiting:
            if s != newest:
                self._abandon(s, f"superseded by step {newest} (the drain is slower than the save cadence)")

    # -- uploading (torch, in a thread) ---------------------------------------------------------
    def _start_upload(self, reqs: dict[int, dict[str, Any]]) -> None:
        if self.upload_thread is not None:
            return
        now = time.monotonic()
        ready = [
            s for s in sorted(reqs)
            if s not in self.awaiting and (self.p.stage(s) / "staged").exists() and self.retry_at.get(s, 0) <= now
        ]
        if not ready:
            return
        step = ready[0]
        req = reqs[step]
        self.uploading = step
        self.upload_result = None
        self._set_status(step, "uploading")

        def work() -> None:
            t0 = time.monotonic()
            try:
                outcome, detail = self._upload(req)
            except BaseException as exc:  # noqa: BLE001 - classified below
                outcome, detail = _classify(exc)
            self.upload_result = (step, outcome, detail)
            # A failed attempt (a store error or an overrun of the store deadline) reads "failed" with
            # its reason, whether or not it is retried; "abandoned" follows when it is not.
            state = "failed" if outcome in ("retry", "abandon") else outcome
            self._set_status(
                step, state, upload_seconds=round(time.monotonic() - t0, 4), detail=detail,
                attempt=self.attempts.get(step, 0) + 1,
            )

        self.upload_thread = threading.Thread(target=work, name=f"gemini-drain-upload-{step}", daemon=True)
        self.upload_thread.start()

    def _reap_upload(self) -> None:
        t = self.upload_thread
        if t is None or t.is_alive():
            return
        t.join()
        self.upload_thread = None
        res, self.upload_result = self.upload_result, None
        step, self.uploading = self.uploading, None
        if res is None or step is None:
            return
        _, outcome, detail = res
        if outcome == "done":
            self._finish(step)
        elif outcome == "await":
            self.awaiting[step] = time.monotonic()
            self._drop_stage_bytes(step)
        elif outcome == "abandon":
            self._abandon(step, detail)
        else:  # retry
            n = self.attempts[step] = self.attempts.get(step, 0) + 1
            if n >= self.max_attempts:
                self._abandon(step, f"gave up after {n} attempts: {detail}")
            else:
                delay = min(60.0, 2.0 ** n)
                self.retry_at[step] = time.monotonic() + delay
                log.warning("step %d: drain attempt %d failed (%s); retrying in %.0f s", step, n, detail, delay)

    def _tier(self, req: dict[str, Any]) -> Any:
        key = (req["url"], req["job_id"])
        t = self.tiers.get(key)
        if t is None:
            from gemini_dcp.persistent.store import PersistentTier  # noqa: PLC0415

            from gemini_dcp.persistent.store import DEFAULT_TIMEOUT_S  # noqa: PLC0415

            t = PersistentTier(
                req["url"], req["job_id"], keep=req.get("keep"), keep_every=req.get("keep_every"), writable=True,
                timeout_s=float(req.get("timeout_s") or DEFAULT_TIMEOUT_S),  # bounds every store call of the upload
            )
            self.tiers[key] = t
        return t

    def _upload(self, req: dict[str, Any]) -> tuple[str, str]:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        from gemini_dcp.persistent.store import PartMarker, node_tag  # noqa: PLC0415
        from gemini_dcp.core.faults import fault_point  # noqa: PLC0415 - torch-free, like this module
        from gemini_dcp.local.records import read_record  # noqa: PLC0415
        from gemini_dcp.persistent.stock_format import exact_view, items_of_record, typed, verify, write_rank_file  # noqa: PLC0415

        step = int(req["step"])
        d = self.p.stage(step)
        ptier = self._tier(req)
        record = read_record(d / "record.rec")
        if record.fingerprint() != req["fingerprint"]:
            return "abandon", "the staged record does not belong to this request"
        staged = json.loads((d / "staged").read_bytes())
        direct = bool(staged.get("direct"))
        progress = _load_progress(d)
        sd = ptier.step_dir(step)
        adopted_from = tuple(req.get("adopted_from") or ())
        node_id = adoption_marker_id(req["node_id"], adopted_from) if adopted_from else req["node_id"]
        if not progress.get("begun"):
            if _already_in_store(ptier, step, req["fingerprint"]):
                return "done", "the store already holds this exact save of the step"
            if adopted_from:
                outcome = _adoption_still_needed(ptier, sd, step, req, node_id)
                if isinstance(outcome, tuple):
                    return outcome
                progress["slots"] = outcome  # the ranks no part marker covers yet, fixed for resumes
            sd.begin(node_id)
            progress["begun"] = True
            progress["threads"] = self.threads  # the file split must not change on resume
            _save_progress(d, progress)
        slots = progress.get("slots", req["slots"])
        threads = int(progress.get("threads", self.threads))
        # An adopting node names its files apart, so it never shares a file with a lost node's
        # torn upload (or with that node itself, should it come back and resume).
        prefix = f"a{node_tag(node_id)[:8]}_" if adopted_from else ""
        what = f"step {step}"
        # One or more data files per saving rank (__<rank>_<k>.distcp, as FileSystemWriter with
        # thread_count=k names them), written in parallel; progress is kept per file.
        jobs: list[tuple[str, Path, list[Any]]] = []
        for rank, slot_path, nbytes in slots:
            items = items_of_record(record, [rank])
            path = Path(slot_path) if direct else d / f"rank-{rank:05d}.bin"
            n_files = threads if nbytes >= SPLIT_BYTES and len(slots) < threads else 1
            for k, bucket in enumerate(_split_by_size(items, n_files)):
                jobs.append((f"__{rank}_{prefix}{k}.distcp", path, bucket))
        files: dict[str, Any] = progress.setdefault("files", {})
        lock = threading.Lock()

        def run(job: tuple[str, Path, list[Any]]) -> None:
            rel, path, items = job
            with _ReadMap(path) as buf:
                if direct:
                    read = _private_reader(buf, what)
                else:
                    def read(it: Any, _buf: Any = buf) -> Any:
                        t = exact_view(_buf.mm, it.offset, it.length)
                        verify(t, it, what)  # checksums verified before upload
                        return typed(t, it)
                result = write_rank_file(sd, rel, items, read, throttle_bps=self.throttle)
            with lock:
                files[rel] = result
                _save_progress(d, progress)
                fault_point("drain.mid_upload")  # one data file in the store

        fault_point("drain.before_upload")
        t_write = time.monotonic()
        todo = [j for j in jobs if j[0] not in files]
        if len(todo) == 1 or threads == 1:
            for j in todo:
                run(j)
        elif todo:
            with ThreadPoolExecutor(max_workers=min(threads, len(todo)), thread_name_prefix="gemini-drain-io") as ex:
                for fut in [ex.submit(run, j) for j in todo]:
                    fut.result()
        if not direct:
            self._drop_stage_bytes(step)  # give the tmpfs back as soon as the bytes are in the store
        storage: dict[Any, Any] = {}
        sums: dict[Any, Any] = {}
        total = 0
        for rel, _path, _items in jobs:
            st, cs, n = files[rel]
            storage.update(st)
            sums.update(cs)
            total += n
        ranks = tuple(sorted(r for r, _, _ in slots))
        t_marker = time.monotonic()
        sd.write_marker(PartMarker(step, req["fingerprint"], node_id, ranks, storage, sums, total, time.time()))
        progress["marker"] = True
        _save_progress(d, progress)
        t_commit = time.monotonic()
        self._set_status(step, "part-written", bytes=total, write_seconds=round(t_marker - t_write, 4),
                         marker_seconds=round(t_commit - t_marker, 4), files=len(jobs))
        fault_point("drain.before_metadata")
        if self._try_commit(req, record):
            self._set_status(step, "committed", commit_seconds=round(time.monotonic() - t_commit, 4))
            return "done", ""
        return ("await", "") if req.get("rank0_node") else ("done", "part written; another node commits")

    def _try_commit(self, req: dict[str, Any], record: Any) -> bool:
        from gemini_dcp.persistent.stock_format import try_finalize  # noqa: PLC0415

        step = int(req["step"])
        if not record.complete:  # the coordinator completes its record in finish(); take that one
            fresh = _completed_record(req, [self.p.stage(step) / "record.rec", Path(req["record_path"])])
            if fresh is None:
                return False
            record = fresh
        ptier = self._tier(req)
        ok, _missing = try_finalize(
            ptier.step_dir(step), step, record.metadata, req["fingerprint"], list(record.metadata.storage_data),
            req["job_id"], prefer_node=dict(enumerate(record.rank_nodes)),
        )
        if ok:
            self._set_status(step, "committed", committed_unix=time.time())
            log.info("step %d committed to %s", step, ptier.step_url(step))
            protect = set(self.p.pending()) - {step}
            try:
                deleted = ptier.apply_retention(protect=protect)
                if deleted:
                    log.info("retention deleted steps %s from %s", deleted, ptier.url)
            except Exception as exc:  # noqa: BLE001 - retention must not undo a commit
                log.warning("retention in %s failed: %s", ptier.url, exc)
        return ok

    def _poll_awaiting(self) -> None:
        if not self.awaiting or time.monotonic() - self.last_await_poll < AWAIT_POLL_S:
            return
        self.last_await_poll = time.monotonic()
        from gemini_dcp.local.records import read_record  # noqa: PLC0415

        for step, since in list(self.awaiting.items()):
            try:
                req = json.loads(self.p.request(step).read_bytes())
                record = read_record(self.p.stage(step) / "record.rec")
                done = self._try_commit(req, record)
            except FileNotFoundError:
                self.awaiting.pop(step, None)
                continue
            except Exception as exc:  # noqa: BLE001
                log.warning("step %d: checking other nodes' parts failed: %s", step, exc)
                done = False
            if done:
                self.awaiting.pop(step, None)
                self._finish(step)
            elif time.monotonic() - since > self.peer_timeout:
                self.awaiting.pop(step, None)
                self._abandon(step, f"other nodes did not write their parts within {self.peer_timeout:.0f} s")

    # -- bookkeeping ------------------------------------------------------------------------------
    def _finish(self, step: int) -> None:
        self._set_status(step, "done")
        self._cleanup(step)

    def _abandon(self, step: int, reason: str) -> None:
        log.warning("step %d: drain abandoned: %s", step, reason)
        self._set_status(step, "abandoned", reason=reason)
        self.awaiting.pop(step, None)
        self._cleanup(step)

    def _cleanup(self, step: int) -> None:
        try:
            os.unlink(self.p.request(step))
        except FileNotFoundError:
            pass
        shutil.rmtree(self.p.stage(step), ignore_errors=True)
        self.attempts.pop(step, None)
        self.retry_at.pop(step, None)

    def _drop_stage_bytes(self, step: int) -> None:
        d = self.p.stage(step)
        for f in d.glob("rank-*.bin"):
            try:
                f.unlink()
            except FileNotFoundError:
                pass

    def _set_status(self, step: int, state: str, **info: Any) -> None:
        with self.status_lock:
            try:
                status = json.loads(self.p.status.read_bytes())
            except (FileNotFoundError, ValueError):
                status = {"steps": {}}
            steps = status.setdefault("steps", {})
            entry = steps.setdefault(str(step), {})
            entry.update(info)
            entry["state"] = state
            entry["unix"] = time.time()
            if len(steps) > STATUS_KEEP:
                for k in sorted(steps, key=int)[: len(steps) - STATUS_KEEP]:
                    steps.pop(k)
            status["pid"] = os.getpid()
            try:
                _write_atomic(self.p.status, json.dumps(status).encode())
            except OSError as exc:  # status is informational (CLI); the drain goes on
                log.debug("drain: could not write %s: %s", self.p.status, exc)


def _classify(exc: BaseException) -> tuple[str, str]:
    """abandon: the bytes can never be uploaded (bad checksum, staged data gone); retry: the store failed."""
    name = type(exc).__name__
    text = f"{name}: {exc}"
    if "ChecksumMismatch" in name and "Persistent" not in name:
        return "abandon", text
    if "Untrusted" in name:  # a refused side file (progress.pkl, a part marker): retrying reads it again
        return "abandon", text
    if isinstance(exc, FileNotFoundError) and "/stage/" in str(exc):
        return "abandon", text
    log.warning("drain upload error: %s", text, exc_info=exc)
    return "retry", text


def _completed_record(req: dict[str, Any], paths: list[Path]) -> Any:
    """The first complete record of the request's save among ``paths`` (its staged copy, which
    ``Drainer.restage`` replaces once the coordinator completed it, then the tier's), or None."""
    from gemini_dcp.local.records import read_record  # noqa: PLC0415

    for path in paths:
        try:
            rec = read_record(path)
        except (OSError, ValueError) as exc:
            log.debug("step %s: no complete record at %s (%s)", req["step"], path, exc)
            continue
        if rec.complete and rec.fingerprint() == req["fingerprint"]:
            return rec
    return None


def adoption_marker_id(node_id: str, adopted_from: tuple[str, ...] | list[str]) -> str:
    """The part-marker identity of ``node_id`` uploading the ranks of the lost nodes ``adopted_from``."""
    return f"{node_id} (adopting {', '.join(sorted(adopted_from))})"


def _adoption_still_needed(
    ptier: Any, sd: Any, step: int, req: dict[str, Any], marker_id: str
) -> tuple[str, str] | list[list[Any]]:
    """The slots of an adoption request that no part marker of the same save covers yet,
    or the request's outcome when nothing is left to do (a newer step is complete: the
    store's retention drops this one anyway; or the lost nodes' parts got there after all)."""
    newer = [s for s in ptier.committed_steps() if s > step]
    if newer:
        return "done", f"step {max(newer)} is complete in the store; step {step} is no longer needed there"
    covered = {
        r for m in sd.read_markers() if m.fingerprint == req["fingerprint"] and m.node_id != marker_id for r in m.ranks
    }
    slots = [s for s in req["slots"] if s[0] not in covered]
    if not slots:
        return "done", "the lost nodes' parts reached the store after all"
    return slots


def _already_in_store(ptier: Any, step: int, fingerprint: str) -> bool:
    """True if ``step`` is complete in the store from the same save (re-draining would only risk it)."""
    try:
        if not ptier.is_complete(step):
            return False
        index = ptier.read_index(step)
    except Exception:  # noqa: BLE001 - unreadable: drain it again
        return False
    return index is not None and index.fingerprint == fingerprint


def _split_by_size(items: list[Any], n: int) -> list[list[Any]]:
    """Deterministic split into ``n`` buckets of similar bytes (largest first), each kept in slot order."""
    if n <= 1 or len(items) <= 1:
        return [items]
    buckets: list[list[Any]] = [[] for _ in range(n)]
    sizes = [0] * n
    for it in sorted(items, key=lambda it: (-it.length, it.offset)):
        i = min(range(n), key=lambda b: (sizes[b], b))
        buckets[i].append(it)
        sizes[i] += it.length
    return [sorted(b, key=lambda it: it.offset) for b in buckets if b]


def _load_progress(d: Path) -> dict[str, Any]:
    """The upload progress of a staged step (fresh if none), decoded without running code.

    A ``progress.pkl`` that names anything but the classes a progress record holds is
    refused (UntrustedDataError, which abandons the step's drain with the reason in its
    status): it was planted or damaged, and nothing in it ever runs.
    """
    path = d / "progress.pkl"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {"begun": False, "files": {}}
    from gemini_dcp.errors import UntrustedDataError  # noqa: PLC0415
    from gemini_dcp.persistent.store import SIDE_FILE_GLOBALS  # noqa: PLC0415
    from gemini_dcp.core.safe_pickle import restricted_loads  # noqa: PLC0415

    obj = restricted_loads(raw, source=str(path), allowed=SIDE_FILE_GLOBALS)
    if not isinstance(obj, dict) or not isinstance(obj.get("files", {}), dict):
        raise UntrustedDataError(
            f"{path} holds a {type(obj).__name__}, not a drain progress record: it was not written by gemini_dcp. "
            "The step's drain is abandoned; remove the job's persist/ directory if this recurs."
        )
    obj.setdefault("files", {})
    return obj


def _save_progress(d: Path, progress: dict[str, Any]) -> None:
    _write_atomic(d / "progress.pkl", pickle.dumps(progress))


def _copy_prefix(src: Path, dst: Path, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` into ``dst`` in the kernel (no GIL-held memcpy)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        if nbytes:
            try:
                os.posix_fallocate(fo.fileno(), 0, nbytes)  # ENOSPC now, not SIGBUS/short write later
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
        done = 0
        while done < nbytes:
            try:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), nbytes - done, done, done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                n = _copy_plain(fi, fo, done, nbytes - done)
            if n == 0:
                raise OSError(errno.EIO, f"{src} is shorter than {nbytes} bytes")
            done += n


def _copy_plain(fi: Any, fo: Any, offset: int, n: int) -> int:
    fi.seek(offset)
    fo.seek(offset)
    left = n
    while left:
        chunk = fi.read(min(left, 16 << 20))
        if not chunk:
            break
        fo.write(chunk)
        left -= len(chunk)
    fo.flush()
    return n - left


class _ReadMap:
    """A file mapped read-only for the upload (closed when done)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mm: Any = None
        self._fd = -1

    def __enter__(self) -> "_ReadMap":
        self._fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        self.mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size else b""
        return self

    def __exit__(self, *exc: Any) -> None:
        if isinstance(self.mm, mmap.mmap):
            try:
                self.mm.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
        os.close(self._fd)


def _private_reader(buf: _ReadMap, what: str) -> Any:
    """Read straight from a live slot: copy out, hash the copy, compare (race-safe)."""
    from gemini_dcp.core.checksum import copy_and_checksum  # noqa: PLC0415
    from gemini_dcp.persistent.stock_format import exact_view, typed  # noqa: PLC0415
    import torch  # noqa: PLC0415

    def read(it: Any) -> Any:
        out = torch.empty(it.length, dtype=torch.uint8)
        if it.length:
            got = copy_and_checksum(out, exact_view(buf.mm, it.offset, it.length), it.algo)
            if got != it.checksum:
                from gemini_dcp.errors import ChecksumMismatchError  # noqa: PLC0415

                raise ChecksumMismatchError(f"{it.name} of {what}: its memory slot was reused before the drain read it.")
        return typed(out, it)

    return read
