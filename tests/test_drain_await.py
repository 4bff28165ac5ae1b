"""The node of rank 0 stops waiting for other nodes' parts of a step once a newer step committed.

The race CI hit: with a save every step, another node's drain coalesced step 1 away (it skipped to
step 2), so step 1's part from that node never came; rank 0's node committed step 2 but kept step 1
"awaiting" until ``peer_timeout_s`` (an hour by default), and ``wait_idle`` never saw an idle drain.
No processes: the server object is driven by hand.
"""

from __future__ import annotations

from pathlib import Path

from gemini_dcp.options.persistent import DrainOptions
from gemini_dcp.persistent.drain import drain_status, server as server_mod
from gemini_dcp.persistent.drain.paths import Paths


def _server(tmp_path: Path) -> server_mod._Server:
    p = Paths(tmp_path / "persist")
    p.requests.mkdir(parents=True)
    p.stage_root.mkdir(parents=True)
    return server_mod._Server(p, lock_fd=-1, idle_s=0.0, options=DrainOptions())


def test_awaited_step_is_abandoned_as_superseded_once_a_newer_step_committed(tmp_path: Path, monkeypatch) -> None:
    srv = _server(tmp_path)
    srv.p.request(1).write_text("{}")  # the request of step 1 (contents not read before the supersede check)
    srv.awaiting[1] = 0.0
    srv._finish(2)  # step 2 committed
    monkeypatch.setattr(server_mod, "AWAIT_POLL_S", 0.0)
    srv._poll_awaiting()
    assert 1 not in srv.awaiting
    st = drain_status(srv.p.dir)
    assert st["steps"]["1"]["state"] == "abandoned" and st["steps"]["1"]["superseded_by"] == 2
    assert st["pending"] == []


def test_awaited_step_keeps_waiting_while_no_newer_step_committed(tmp_path: Path, monkeypatch) -> None:
    srv = _server(tmp_path)
    srv.awaiting[3] = 1e18  # "since": far future, so the peer timeout cannot fire
    srv._finish(2)  # an older step finished: no reason to give up on 3
    monkeypatch.setattr(server_mod, "AWAIT_POLL_S", 0.0)
    monkeypatch.setattr(srv, "_upload_side", lambda: type("U", (), {"try_commit": staticmethod(lambda req: False)})())
    srv.p.request(3).write_bytes(b"not json")  # unreadable request: logged, still waiting
    srv._poll_awaiting()
    assert 3 in srv.awaiting
