"""A drain process that is starting is not started again (``starting.lock``), without a process.

Every call that finds ``daemon.lock`` free starts a plain drain server: a due step, and every rank's
``wait_persisted()`` once a second. Until the new process holds ``daemon.lock`` (seconds on a loaded
host) it holds ``starting.lock``; the soak once saw 24 drain processes started in one second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gemini_dcp.options.persistent import DrainOptions
from gemini_dcp.persistent.drain import client, server
from gemini_dcp.persistent.drain.lock import lock_free
from gemini_dcp.persistent.drain.paths import Paths


class _Child:
    """Stands in for the started process: it keeps the descriptors it inherited (pass_fds) open."""

    def __init__(self, argv: list[str], pass_fds: tuple[int, ...] = (), **_: Any) -> None:
        self.argv = argv
        self.fds = [os.dup(fd) for fd in pass_fds]
        self.pid = 0

    def takes_the_lock(self) -> None:  # what server.serve() does once daemon.lock is its own
        for fd in self.fds:
            os.close(fd)


@pytest.fixture()
def started(monkeypatch: pytest.MonkeyPatch) -> list[_Child]:
    children: list[_Child] = []

    def popen(argv: list[str], **kw: Any) -> _Child:
        children.append(_Child(argv, **kw))
        return children[-1]

    monkeypatch.setattr(client.subprocess, "Popen", popen)
    monkeypatch.setattr(client, "lower_priority", lambda *a, **k: None)
    return children


def test_a_starting_server_is_not_started_again(tmp_path: Path, started: list[_Child]) -> None:
    p = Paths(tmp_path / "j" / "persist")
    p.dir.mkdir(parents=True, mode=0o700)
    opts = DrainOptions()
    for _ in range(5):  # a due step, then every rank's wait_persisted() polls while it starts
        client.ensure_server(p.dir, "process", options=opts)
    assert len(started) == 1
    assert "--starting-fd" in started[0].argv and not lock_free(p.starting_lock, p.dir)
    started[0].takes_the_lock()  # (or it died: its descriptors close alike)
    client.ensure_server(p.dir, "process", options=opts)  # daemon.lock is still free here: a new start
    assert len(started) == 2
    started[1].takes_the_lock()


def test_a_standby_or_warming_start_does_not_take_the_starting_lock(tmp_path: Path, started: list[_Child]) -> None:
    p = Paths(tmp_path / "j" / "persist")
    p.dir.mkdir(parents=True, mode=0o700)
    client.ensure_server(p.dir, "process", options=DrainOptions(), warm_first=True)
    assert len(started) == 1 and "--starting-fd" not in started[0].argv and "--warming-fd" in started[0].argv
    assert lock_free(p.starting_lock, p.dir)
    started[0].takes_the_lock()


def test_the_server_lets_go_of_the_starting_lock_once_it_holds_the_server_lock(tmp_path: Path) -> None:
    p = Paths(tmp_path / "j" / "persist")
    p.dir.mkdir(parents=True, mode=0o700)
    held = os.open(p.starting_lock, os.O_RDWR | os.O_CREAT, 0o600)
    assert client.try_flock(held)
    inherited = os.dup(held)
    os.close(held)  # the trainer's copy; the server's is ``inherited``
    server.serve(str(p.dir), options=DrainOptions(), idle_s=0.0, starting_fd=inherited)  # nothing pending: returns
    with pytest.raises(OSError):
        os.fstat(inherited)
    assert lock_free(p.starting_lock, p.dir)
