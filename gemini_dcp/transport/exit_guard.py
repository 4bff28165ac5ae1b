"""Exit guard: a process that leaves without ``destroy_process_group`` must not abort in gloo's threads.

The abort (SIGABRT, "terminate called without an active exception"), found with gdb on torch
2.13 / CPython 3.11: ``ProcessGroupGloo``'s worker threads (``pt_gloo_runloop``) destroy a
finished collective's work object *after* the caller's ``wait()`` has returned, in
``ProcessGroupGloo::runLoop``. Its tensors have Python objects, and releasing them
(``c10::TensorImpl::decref_pyobject`` from ``~AsyncWork``) takes the GIL. Once the interpreter
is finalizing, a thread that takes the GIL is ended (``PyThread_exit_thread``: ``pthread_exit``);
the forced unwind meets the ``noexcept`` destructor and the C++ runtime calls ``std::terminate``.
So any process whose main thread reaches finalization before a worker thread has dropped its
last work aborts. It is rare and needs a loaded host (the worker descheduled between completing
the work and dropping it): a survivor that loads ``{}`` and exits right after ``dcp.load``
(whose last step is DCP's own ``all_gather_object`` on the default group) hit it about once in
10-20 exits. With the worker delayed in ``~AsyncWork`` under gdb it aborts every time, with a
plain ``dist.all_gather_object`` and no gemini_dcp code at all: the race is torch's, the guard
is ours.

:func:`install` registers an ``atexit`` hook (atexit runs before the interpreter starts
finalizing) that releases the GIL until every gloo worker thread of the process is idle,
that is blocked in its untimed condition wait (read from ``/proc/self/task/<tid>/syscall``:
a ``futex`` wait without a timeout), so each has dropped its last work while taking the GIL was
still allowed. Bounded: at most :data:`EXIT_WAIT_S` (a worker still inside a collective with a
peer that died does not hold the exit longer; ``$GEMINI_DCP_EXIT_WAIT_S`` changes it, 0 turns
the wait off). Linux only; elsewhere, or where ``/proc`` is
unreadable, the hook returns at once. Torch-free. No collective: any rank may exit on its own.
"""

from __future__ import annotations

import atexit
import os
import platform
import threading
import time

from ..options.process import EXIT_WAIT_S, exit_wait_s

__all__ = ["EXIT_WAIT_S", "busy_gloo_workers", "install", "wait_gloo_idle"]

_POLL_S = 0.002
_WORKER_NAME = "pt_gloo_runloop"  # c10::setThreadName in ProcessGroupGloo's worker threads
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_TASKS = "/proc/self/task"

_installed = False
_lock = threading.Lock()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def busy_gloo_workers() -> list[int] | None:
    """Thread ids of this process's gloo worker threads that are not idle; None if unknown here.

    Idle: sleeping in a ``futex`` wait with no timeout (its queue's condition variable). A worker
    running, runnable, or in a timed wait (for the GIL, or for a peer inside a collective) is busy.
    """
    if _FUTEX is None:
        return None
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    busy: list[int] = []
    for tid in tids:
        if (_read(f"{_TASKS}/{tid}/comm") or "").strip() != _WORKER_NAME:
            continue
        stat = _read(f"{_TASKS}/{tid}/stat")
        syscall = _read(f"{_TASKS}/{tid}/syscall")
        if stat is None or syscall is None:  # gone meanwhile (idle enough), or /proc not readable
            if stat is not None:
                return None
            continue
        state = stat.rsplit(")", 1)[-1].split()[:1]
        fields = syscall.split()
        idle = state == ["S"] and len(fields) > 4 and fields[0] == str(_FUTEX) and int(fields[4], 16) == 0
        if not idle:
            busy.append(int(tid))
    return busy


def wait_gloo_idle(limit_s: float = EXIT_WAIT_S, poll_s: float = _POLL_S) -> bool:
    """Release the GIL until every gloo worker thread is idle, at most ``limit_s``.

    Returns True when they all are (or there are none), False on the deadline or where it
    cannot be told (not Linux, ``/proc`` unreadable).
    """
    deadline = time.monotonic() + limit_s
    while True:
        busy = busy_gloo_workers()
        if busy is None:
            return False
        if not busy:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)  # the GIL is free meanwhile: a worker that needs it takes it


def _at_exit() -> None:
    try:
        wait_gloo_idle(exit_wait_s())  # a bad value reads as the default: never an error at exit
    except Exception:  # noqa: BLE001 - an exit hook must never turn a clean exit into an error
        pass


def install() -> None:
    """Register the exit hook once per process (idempotent; cheap). Call it where the package
    first uses ``torch.distributed``; no collective, no effect before the interpreter exits."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            atexit.register(_at_exit)
            _installed = True
