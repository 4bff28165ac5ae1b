"""The drain server: the detached process (or thread) that stages, uploads and commits a node's requests.

Started by module name — ``python -m gemini_dcp.persistent.drain.server <persist_dir>
--options <DrainOptions JSON> [--standby]`` — by :func:`gemini_dcp.persistent.drain.client.ensure_server`,
or run as a thread of the training process (``memory://`` stores, or drain mode ``thread``).
It parses no environment variable: the trainer validated its :class:`DrainOptions` and passes
them on the command line. It holds ``daemon.lock`` (one server per node and job), readies its
upload side in the background as it starts (:func:`_prewarm`), takes each new request at once
(no torch): one it can upload now is read in place from its held memory slots, one that
waits behind another upload is copied aside and its holds dropped; it coalesces requests it
cannot start yet (the newest wins), uploads one step at a time in a thread (:mod:`.upload`),
keeps the slot holds of pending requests fresh, retries a failed upload with backoff up to ``attempts`` times, waits up to
``peer_timeout_s`` for the other nodes' parts on the node of rank 0, and exits after
``idle_s`` with nothing to do.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ...core.faults import fault_point
from ...errors import ChecksumMismatchError, GeminiError, PersistentTierError, UntrustedDataError
from ...local.slot_holds import HOLD_S, refresh_holds, release_holds
from ...options.persistent import DrainOptions
from .lock import STANDBY_S, lock_free, lock_held, take_lock, try_flock
from .paths import Paths, private_dir, write_atomic
from .request import DrainRequest
from .stage import copy_prefix
from .status import StatusBook

__all__ = ["POLL_S", "classify", "main", "serve", "warm_then_serve"]

log = logging.getLogger("gemini_dcp.persistent.drain")

POLL_S = 0.05
BRIDGE_HANDOVER_S = 60.0  # how long a warm server waits for a bridge to hand the lock over
AWAIT_POLL_S = 0.5


def main(argv: list[str] | None = None) -> None:
    """Entry point of the detached drain process (``python -m gemini_dcp.persistent.drain.server``)."""
    parser = argparse.ArgumentParser(
        prog="python -m gemini_dcp.persistent.drain.server",
        description="Drain server of one job on one node (started by the trainer; not for direct use).",
    )
    parser.add_argument("persist_dir", help="the job's drain state directory, <tier root>/<job_id>/persist[/adopt]")
    parser.add_argument("--options", default=None, help="the trainer's validated DrainOptions, as JSON")
    parser.add_argument("--standby", action="store_true", help="wait for a dying server's lock while requests are pending")
    parser.add_argument("--warm-first", action="store_true",
                        help="import the upload side before taking the lock (started with the writer)")
    parser.add_argument("--base-nice", type=int, default=None, help="the trainer's niceness (the drain's is relative)")
    parser.add_argument("--warming-fd", type=int, default=None,
                        help="with --warm-first: an inherited descriptor of warming.lock, already locked by the trainer")
    parser.add_argument("--starting-fd", type=int, default=None,
                        help="an inherited descriptor of starting.lock, locked by the trainer: closed once this "
                             "server holds daemon.lock or gives up")
    args = parser.parse_args(argv)
    options = DrainOptions.from_json(args.options) if args.options else DrainOptions()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s drain[{os.getpid()}] %(levelname)s %(message)s")
    lower_priority(options.nice, base=args.base_nice)
    # A server that waits for requests readies its upload side (torch) in the background; one that
    # exits as soon as it is idle (idle_s 0) has nothing to wait for and stays light to the end.
    if args.warm_first:
        warm_then_serve(args.persist_dir, options, warming_fd=args.warming_fd)
        return
    serve(args.persist_dir, options=options, idle_s=options.idle_s, standby_s=STANDBY_S if args.standby else 0.0,
          prewarm=options.idle_s > 0, starting_fd=args.starting_fd)


def warm_then_serve(persist_dir: str, options: DrainOptions, *, warming_fd: int | None = None) -> None:
    """The server a writer starts when it is built: import the upload side first (holding
    ``warming.lock``), then take the server lock — waiting for it while a *bridge* holds it.

    A due step that comes while this process still imports torch does not wait for the import:
    the trainer finds ``warming.lock`` held and the server lock free, and serves the request in
    a thread of its own process, which has torch already (:func:`serve` with ``bridge=True``,
    started by :func:`gemini_dcp.persistent.drain.client.ensure_server`). The bridge gives the lock
    up as soon as this process is warm and it has no upload running; this process then takes it
    and serves every later step. Returns at once if a server already holds the lock or another
    process is warming. ``warming_fd``: ``warming.lock`` as the trainer locked it before it started
    this process (so a request the trainer writes at once already finds it held).
    """
    p = Paths(persist_dir)
    wfd = _open_lock(p, p.warming_lock) if warming_fd is None else warming_fd
    if wfd is None:
        return
    try:
        if warming_fd is not None:
            write_atomic(p.pid, str(os.getpid()).encode())  # the node's drain process, warming (a bridge never writes it)
        # Started by a trainer that found the server lock free and handed us warming.lock: whoever holds the
        # server lock now is its bridge, to be waited for. Otherwise a held lock means a server serves.
        if warming_fd is None and (not try_flock(wfd) or not lock_free(p.lock, p.dir)):
            return  # another server warms, or one already serves
        _prewarm()
    finally:
        os.close(wfd)  # warm (or failed to be): a bridge hands over now
    if not p.dir.is_dir():
        return  # the job's memory was removed meanwhile: never make its directory again
    try:
        fd = os.open(p.lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    deadline = time.monotonic() + max(options.idle_s, BRIDGE_HANDOVER_S)
    while not try_flock(fd):
        if time.monotonic() >= deadline or not p.dir.is_dir():
            os.close(fd)  # another server serves (it was not a bridge): nothing for this one to do
            return
        time.sleep(POLL_S)
    _serve_locked(p, fd, options.idle_s, options)


def lower_priority(setting: int | str, *, pid: int = 0, base: int | None = None) -> None:
    """Training first: ``idle`` (SCHED_IDLE: run only on otherwise idle CPUs) or ``setting`` added to the
    trainer's niceness ``base`` (default: this process's). Idempotent — the trainer applies it to the
    drain process it has just started (``pid``), before that process's own start-up competes with
    training, and the drain process applies it again."""
    try:
        if setting == "idle":
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        else:
            nice = os.getpriority(os.PRIO_PROCESS, 0) if base is None else base
            target = min(19, nice + int(setting))
            if os.getpriority(os.PRIO_PROCESS, pid) < target:
                os.setpriority(os.PRIO_PROCESS, pid, target)
    except (OSError, ValueError, AttributeError) as exc:  # the drain still works, at normal priority
        log.warning("drain: could not lower priority to %r (%s); running at normal priority", setting, exc)


def serve(
    persist_dir: str, *, options: DrainOptions | None = None, idle_s: float = 60.0, standby_s: float = 0.0,
    prewarm: bool = False, bridge: bool = False, starting_fd: int | None = None,
) -> None:
    """Run the drain server of ``persist_dir`` until idle.

    Returns at once if another server holds the lock, unless ``standby_s > 0``: then it waits
    for the lock (up to ``standby_s``) while requests are pending and no other standby waits.
    ``prewarm`` (the detached process only): once the lock is ours, ready the upload side in
    the background (:func:`_prewarm`). ``bridge`` (a thread of the training process, while the
    node's server imports its upload side: :func:`warm_then_serve`): return as soon as that
    server is warm and no upload of ours runs. ``starting_fd`` (``starting.lock``, held since the
    trainer started this process): closed once the lock is ours or another server's.
    """
    p = Paths(persist_dir)
    try:
        fd = _open_lock(p, p.lock)
        if fd is None:
            return
        if not take_lock(p, fd, standby_s):
            os.close(fd)
            return
    finally:
        if starting_fd is not None:
            os.close(starting_fd)  # a call that finds daemon.lock free from now on starts a server again
    if prewarm:
        threading.Thread(target=_prewarm, name="gemini-drain-prewarm", daemon=True).start()
    _serve_locked(p, fd, idle_s, options or DrainOptions(), bridge=bridge)


def _open_lock(p: Paths, path: Path) -> int | None:
    """A descriptor of the lock file ``path`` in the drain's private directory (None: it cannot be made)."""
    try:
        private_dir(p.dir)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None


def _serve_locked(p: Paths, fd: int, idle_s: float, options: DrainOptions, *, bridge: bool = False) -> None:
    """Serve with the lock held on ``fd`` (closed at the end, which drops the lock). A bridge leaves
    ``daemon.pid`` alone: it names the node's drain process, never the training process."""
    try:
        if not bridge:
            write_atomic(p.pid, str(os.getpid()).encode())
        _Server(p, fd, idle_s, options, bridge=bridge).run()
    except Exception:  # noqa: BLE001 - a server error must not escape into a training thread
        log.exception("drain server for %s failed", p.dir)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def classify(exc: BaseException) -> tuple[str, str]:
    """abandon: the bytes can never be uploaded (bad checksum, refused side file, staged data gone);
    retry: the store failed (a store error, an overrun of its deadline)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ChecksumMismatchError) and not isinstance(exc, PersistentTierError):
        return "abandon", text
    if isinstance(exc, UntrustedDataError):  # a refused side file (a part marker): retrying reads it again
        return "abandon", text
    if isinstance(exc, FileNotFoundError) and "/stage/" in str(exc):
        return "abandon", text
    log.warning("drain upload error: %s", text, exc_info=exc)
    return "retry", text


def _prewarm() -> None:
    """Import the upload side (torch) while the server waits for its first request, so the first
    due step of a process uploads as fast as later ones; staging never waits for it. In this
    process of its own the drain also turns off the zip CRC32 of ``torch.save`` (stock ``dcp.load``
    reads such files; each item keeps its crc32c in the step's index)."""
    try:
        upload = _uploader_module()
        upload.prepare_process()
    except Exception as exc:  # noqa: BLE001 - the first upload imports it again and reports
        log.warning("drain: preloading the upload side failed: %s", exc)


def _uploader_module() -> ModuleType:
    """:mod:`.upload`, imported on the first upload: it brings torch, which staging does without."""
    from . import upload  # noqa: PLC0415 - torch, only once a step uploads (the server starts light)

    return upload


class _Server:
    def __init__(self, p: Paths, lock_fd: int, idle_s: float, options: DrainOptions, *, bridge: bool = False) -> None:
        self.p = p
        self.bridge = bridge
        self.lock_fd = lock_fd
        self.idle_s = idle_s
        self.options = options
        self.status = StatusBook(p)
        self.uploader: Any = None  # upload.Uploader, made on the first upload
        self.uploading: int | None = None
        self.upload_thread: threading.Thread | None = None
        self.upload_result: tuple[int, str, str] | None = None
        self.awaiting: dict[int, float] = {}  # step -> monotonic time its part was done
        self.attempts: dict[int, int] = {}
        self.retry_at: dict[int, float] = {}
        self.last_await_poll = 0.0
        self.last_hold_refresh = 0.0
        # step -> fingerprint of the save whose request is uploading or awaiting (a rollback's new save of the
        # same step number writes another request over it: see _forget_replaced)
        self.work_fp: dict[int, str] = {}
        # step -> when its request was written, of the steps this server finished (on rank 0's node: committed)
        self.finished: dict[int, float] = {}

    def _upload_side(self) -> Any:
        if self.uploader is None:
            self.uploader = _uploader_module().Uploader(self.p, self.options, self.status)
        return self.uploader

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        idle_since = time.monotonic()
        while True:
            if not self.p.dir.is_dir():
                log.info("drain state %s is gone; exiting", self.p.dir)
                return
            if self.bridge and self.upload_thread is None and not self.awaiting and not lock_held(self.p.warming_lock):
                return  # the node's server is warm: it takes the lock (and what is pending) from here
            # An upload that finished since the last pass is reaped first: a request that arrives right
            # after it (a save waiting for each drain) is read in place, not copied as if behind an upload.
            self._reap_upload()
            reqs = self._forget_replaced(self._drop_abandoned_timeline(self._requests()))
            # Busy: an upload still reads slot bytes (one that only commits and applies retention is not).
            busy = self.upload_thread is not None and not (self.uploader is not None and self.uploader.slots_read.is_set())
            for step, req in sorted(reqs.items()):
                if step not in self.awaiting and step != self.uploading and not (self.p.stage(step) / "staged").exists():
                    self._stage(req, copy=busy)
                    busy = True
            self._refresh_holds(reqs)
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

    def _requests(self) -> dict[int, DrainRequest]:
        out = {}
        for step in self.p.pending():
            path = self.p.request(step)
            try:
                out[step] = DrainRequest.from_json(path.read_bytes(), str(path))
            except FileNotFoundError:
                continue
            except GeminiError as exc:  # another release's request, or not a request at all: never uploaded
                self._abandon(step, str(exc))
        return out

    def _drop_abandoned_timeline(self, reqs: dict[int, DrainRequest]) -> dict[int, DrainRequest]:
        """Abandon the requests of steps a rollback left behind (:mod:`gemini_dcp.core.timelines`): a
        request for a *lower* step written after them means the job went back and saves a new timeline.        """
        newest_written = max(reqs.values(), key=lambda r: r.created_unix, default=None)
        if newest_written is None:
            return reqs
        low = newest_written.step
        for step in [s for s in reqs if s > low and reqs[s].created_unix < newest_written.created_unix]:
            if step == self.uploading:
                continue  # let it finish: the store's history marks it abandoned, and its retention drops it
            self._abandon(step, f"a rollback abandoned its timeline (step {low} was saved after it)")
            del reqs[step]
        return reqs

    def _forget_replaced(self, reqs: dict[int, DrainRequest]) -> dict[int, DrainRequest]:
        """Drop the work on a step whose request another save of the same number replaced (after a
        rollback): that request is staged and uploaded anew (an upload in flight is let finish, and
        its outcome ignored: :meth:`_reap_upload`)."""
        for step, req in reqs.items():
            fp = self.work_fp.get(step)
            if fp is not None and fp != req.fingerprint and step != self.uploading:
                log.info("step %d: another save of this step number replaced its request (a rollback); draining it", step)
                self.awaiting.pop(step, None)
                self.work_fp.pop(step, None)
                self.attempts.pop(step, None)
                self.retry_at.pop(step, None)
        return reqs

    # -- staging (no torch) -------------------------------------------------------------------
    def _stage(self, req: DrainRequest, *, copy: bool) -> None:
        """Make ``req`` ready to upload: read in place from its held slots when it uploads next
        (``copy`` False and the request holds its slots), else copy the slot bytes beside it and
        release the holds, so a request that waits behind another upload never pins memory slots."""
        step = req.step
        d = self.p.stage(step)
        t0 = time.monotonic()
        try:
            private_dir(d)
            need = sum(s.nbytes for s in req.slots)
            direct = bool(req.holds) and not copy
            if not direct:
                st = os.statvfs(d)
                free = st.f_bavail * st.f_frsize
                direct = need > free - (64 << 20)
                if direct:
                    log.warning(
                        "step %d: not enough tmpfs for a staging copy (%.3f GiB needed, %.3f free): draining straight "
                        "from the memory slots (abandoned if a newer save reuses them first)",
                        step, need / 2**30, free / 2**30,
                    )
                else:
                    for s in req.slots:
                        copy_prefix(Path(s.path), d / f"rank-{s.rank:05d}.bin", s.nbytes)
                    release_holds(req.holds, step)
            write_atomic(d / "staged", json.dumps({"direct": direct, "held": direct and bool(req.holds),
                                                   "seconds": time.monotonic() - t0}).encode())
            self.status.set(step, "staged", fresh=True, fingerprint=req.fingerprint, bytes=need,
                            stage_seconds=round(time.monotonic() - t0, 4), in_place=direct)
        except FileNotFoundError as exc:
            self._abandon(step, f"its memory slot is gone before it could be staged ({exc})", fingerprint=req.fingerprint)
        except OSError as exc:
            self._abandon(step, f"staging failed: {exc}", fingerprint=req.fingerprint)

    def _refresh_holds(self, reqs: dict[int, DrainRequest]) -> None:
        """Keep the holds of the steps still to be read alive (a dead server's lapse after ``HOLD_S``)."""
        now = time.monotonic()
        if now - self.last_hold_refresh < HOLD_S / 8:
            return
        self.last_hold_refresh = now
        refresh_holds(h for req in reqs.values() for h in req.holds)

    def _coalesce(self, reqs: dict[int, DrainRequest]) -> None:
        waiting = [
            s for s in reqs
            if s != self.uploading and s not in self.awaiting and (self.p.stage(s) / "staged").exists()
        ]
        if len(waiting) <= 1:
            return
        newest = max(waiting)
        for s in waiting:
            if s != newest:
                self._abandon(s, f"superseded by step {newest} (the drain is slower than the save cadence)",
                              superseded_by=newest)

    # -- uploading (torch, in a thread) ---------------------------------------------------------
    def _start_upload(self, reqs: dict[int, DrainRequest]) -> None:
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
        self.work_fp[step] = req.fingerprint
        self.upload_result = None
        self.status.set(step, "uploading")
        self._upload_side().slots_read.clear()

        def work() -> None:
            t0 = time.monotonic()
            try:
                if self.bridge:
                    fault_point("drain.bridge_upload")  # the training process uploads this step
                uploader = self._upload_side()
                # A bridge uploads in the training process: no zip CRC32 for its files (as in the drain's own
                # process, prepare_process), only while it uploads.
                with _uploader_module().zip_crc_off() if self.bridge else contextlib.nullcontext():
                    outcome, detail = uploader.upload(req)
            except BaseException as exc:  # noqa: BLE001 - classified below
                outcome, detail = classify(exc)
            self.upload_result = (step, outcome, detail)
            # A failed attempt (a store error or an overrun of the store deadline) reads "failed" with
            # its reason, whether or not it is retried; "abandoned" follows when it is not.
            state = "failed" if outcome in ("retry", "abandon") else outcome
            self.status.set(
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
        if self._replaced(step):  # the outcome is of a save whose request another one replaced meanwhile
            self.work_fp.pop(step, None)
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
            if n >= self.options.attempts:
                self._abandon(step, f"gave up after {n} attempts: {detail}")
            else:
                delay = min(60.0, 2.0 ** n)
                self.retry_at[step] = time.monotonic() + delay
                log.warning("step %d: drain attempt %d failed (%s); retrying in %.0f s", step, n, detail, delay)

    def _poll_awaiting(self) -> None:
        if not self.awaiting or time.monotonic() - self.last_await_poll < AWAIT_POLL_S:
            return
        self.last_await_poll = time.monotonic()
        for step, since in list(self.awaiting.items()):
            path = self.p.request(step)
            req: DrainRequest | None = None
            try:
                req = DrainRequest.from_json(path.read_bytes(), str(path))
            except FileNotFoundError:
                self.awaiting.pop(step, None)
                continue
            except (OSError, GeminiError) as exc:  # unreadable: logged, still waiting (the peer timeout ends it)
                log.warning("step %d: checking other nodes' parts failed: %s", step, exc)
            # A newer step saved after this one (never one of a timeline a rollback abandoned) is in the store.
            written = req.created_unix if req is not None else 0.0
            newer = [s for s, done_at in self.finished.items() if s > step and done_at >= written]
            if newer:
                # Another node may have coalesced this step away (its drain skipped to a newer
                # one), so its part may never come; a newer step is in the store, so stop waiting.
                self._abandon(step, f"superseded by step {max(newer)}, committed while this step "
                              "waited for the other nodes' parts", superseded_by=max(newer))
                continue
            done = False
            if req is not None:
                try:
                    done = self._upload_side().try_commit(req)
                except Exception as exc:  # noqa: BLE001
                    log.warning("step %d: checking other nodes' parts failed: %s", step, exc)
            if done:
                self.awaiting.pop(step, None)
                self._finish(step)
            elif time.monotonic() - since > self.options.peer_timeout_s:
                self.awaiting.pop(step, None)
                self._abandon(step, f"other nodes did not write their parts within {self.options.peer_timeout_s:.0f} s")

    # -- bookkeeping ------------------------------------------------------------------------------
    def _finish(self, step: int) -> None:
        path = self.p.request(step)
        try:  # when its save was requested: a step of an abandoned timeline supersedes nothing saved after it
            self.finished[step] = DrainRequest.from_json(path.read_bytes(), str(path)).created_unix
        except (OSError, GeminiError):
            self.finished[step] = time.time()
        for old in sorted(self.finished)[:-16]:
            del self.finished[old]
        self.status.set(step, "done")
        self._cleanup(step)

    def _abandon(self, step: int, reason: str, *, superseded_by: int | None = None, fingerprint: str | None = None) -> None:
        log.warning("step %d: drain abandoned: %s", step, reason)
        info: dict[str, Any] = {"superseded_by": superseded_by} if superseded_by is not None else {}
        if fingerprint is not None:  # abandoned before it was staged: its entry starts anew
            info.update(fresh=True, fingerprint=fingerprint)
        self.status.set(step, "abandoned", reason=reason, **info)
        self.awaiting.pop(step, None)
        self._cleanup(step)

    def _replaced(self, step: int) -> bool:
        """Whether the request of ``step`` now is of another save than the one this server worked on."""
        fp = self.work_fp.get(step)
        path = self.p.request(step)
        try:
            return fp is not None and DrainRequest.from_json(path.read_bytes(), str(path)).fingerprint != fp
        except (OSError, GeminiError):
            return False

    def _cleanup(self, step: int) -> None:
        self.work_fp.pop(step, None)
        path = self.p.request(step)
        try:
            release_holds(DrainRequest.from_json(path.read_bytes(), str(path)).holds, step)
        except (OSError, GeminiError):
            pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        shutil.rmtree(self.p.stage(step), ignore_errors=True)
        self.attempts.pop(step, None)
        self.retry_at.pop(step, None)

    def _drop_stage_bytes(self, step: int) -> None:
        for f in self.p.stage(step).glob("rank-*.bin"):
            try:
                f.unlink()
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    main()
