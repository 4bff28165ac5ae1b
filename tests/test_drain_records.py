"""The drain's typed JSON records (request, config, progress), the previous release's formats,
and the server started by module name without torch.

Fast: one short-lived subprocess (the server, with nothing to do), no process group.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from gemini_dcp.errors import ChecksumMismatchError, IncompatibleCheckpointError, UntrustedDataError
from gemini_dcp.options import DrainOptions
from gemini_dcp.persistent.drain import (
    DrainConfig,
    DrainRequest,
    Paths,
    Progress,
    SlotRef,
    StoreTarget,
    drain_status,
    drain_summary,
    read_config,
)
from gemini_dcp.persistent.drain.request import FileResult, StoredItem

REPO = Path(__file__).resolve().parents[1]
STORE = StoreTarget(url="file:///tmp/store", job_id="job", keep=2, keep_every=None, timeout_s=30.0)


def _request(**kw: object) -> DrainRequest:
    fields: dict[str, object] = dict(
        step=12, root="/dev/shm/g", record_path="/dev/shm/g/job/step.rec", node_id="host:/dev/shm/g",
        fingerprint="abc123", slots=(SlotRef(rank=0, path="/dev/shm/g/job/slot-0", nbytes=4096),
                                     SlotRef(rank=1, path="/dev/shm/g/job/slot-1", nbytes=8192)),
        store=STORE, rank0_node=True, adopted_from=("lost:/r",), created_unix=1.5,
    )
    fields.update(kw)
    return DrainRequest(**fields)  # type: ignore[arg-type]


def test_request_round_trips_through_json() -> None:
    req = _request()
    text = req.to_json()
    assert json.loads(text)["version"] == 2
    assert DrainRequest.from_json(text) == req
    assert DrainRequest.from_json(_request(adopted_from=(), rank0_node=False).to_json()).adopted_from == ()


def test_request_of_the_previous_release_is_read() -> None:
    v1 = {
        "version": 1, "step": 3, "root": "/r", "record_path": "/r/j/rec", "node_id": "n", "fingerprint": "f",
        "slots": [[0, "/r/j/s0", 10]], "created_unix": 2.0, "url": "file:///s", "job_id": "j", "keep": 2,
        "keep_every": None, "timeout_s": 300.0, "rank0_node": True,
    }
    req = DrainRequest.from_json(json.dumps(v1))
    assert req.version == 1 and req.store == StoreTarget(url="file:///s", job_id="j", keep=2, timeout_s=300.0)
    assert req.slots == (SlotRef(rank=0, path="/r/j/s0", nbytes=10),) and req.rank0_node


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (json.dumps({**_request().to_dict(), "version": 3}), r"has version 3; this gemini_dcp reads versions 1..2"),
        (json.dumps({**_request().to_dict(), "version": "2"}), r"has version '2'"),
        (json.dumps({k: v for k, v in _request().to_dict().items() if k != "version"}), r"has version None"),
        ("[1, 2]", r"holds a list, not a record"),
        ("{not json", r"is not valid JSON"),
        (json.dumps({**_request().to_dict(), "slots": [[0, "/p"]]}), r"is not \[rank, path, nbytes\]"),
        (json.dumps({**_request().to_dict(), "step": "12"}), r"field 'step' is '12'"),
    ],
)
def test_a_newer_or_foreign_request_is_refused(text: str, message: str) -> None:
    with pytest.raises(IncompatibleCheckpointError, match=message):
        DrainRequest.from_json(text, "requests/step-12.json")


def test_drain_options_and_config_round_trip(tmp_path: Path) -> None:
    opts = DrainOptions(mode="process", idle_s=3.0, throttle_bps=1024.0, nice="idle", threads=4, attempts=2)
    assert DrainOptions.from_json(opts.to_json()) == opts
    from gemini_dcp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"version 2: this gemini_dcp reads version 1"):
        DrainOptions.from_json(json.dumps({**opts.to_dict(), "version": 2}))
    with pytest.raises(ConfigError, match=r"unknown fields \['turbo'\]"):
        DrainOptions.from_json(json.dumps({**opts.to_dict(), "turbo": True}))
    cfg = DrainConfig(store=STORE, every=5, mode="process", protocol="file", drain=opts)
    assert DrainConfig.from_json(cfg.to_json()) == cfg
    p = Paths(tmp_path / "persist")
    p.dir.mkdir()
    assert read_config(p.dir) is None and drain_summary(p.dir) is None
    p.config.write_text(cfg.to_json())
    assert read_config(p.dir) == cfg
    summary = drain_summary(p.dir)
    assert summary is not None and summary["url"] == STORE.url and summary["every"] == 5
    # the previous release's flat config.json (adoption after an upgrade): default drain options
    p.config.write_text(json.dumps({"version": 1, "url": "file:///s", "job_id": "j", "keep": 2, "keep_every": None,
                                    "timeout_s": 300.0, "every": 3, "mode": "thread", "protocol": "file"}))
    old = read_config(p.dir)
    assert old is not None and old.every == 3 and old.mode == "thread" and old.drain == DrainOptions()
    p.config.write_text(json.dumps({**json.loads(cfg.to_json()), "version": 9}))
    assert read_config(p.dir) is None  # another release's config: ignored (logged), never misread


def test_progress_round_trips_and_reads_the_previous_pickle(tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from gemini_dcp.persistent.drain.upload import decode_file, encode_file, load_progress, save_progress

    storage = {MetadataIndex("w", torch.Size([0, 4]), 1): _StorageInfo("__0_0.distcp", 0, 100),
               MetadataIndex("step"): _StorageInfo("__0_0.distcp", 100, 8)}
    sums = {MetadataIndex("w", torch.Size([0, 4]), 1): ("xxh3", 2**63 + 5)}
    fr = encode_file(storage, sums, 108)
    assert decode_file(fr) == (storage, sums, 108)
    prog = Progress(begun=True, threads=2, slots=(SlotRef(rank=1, path="/s", nbytes=9),),
                    files={"__0_0.distcp": fr}, marker=False)
    assert Progress.from_json(prog.to_json()) == prog
    d = tmp_path / "stage" / "step-000000000001"
    d.mkdir(parents=True)
    assert load_progress(d) == Progress()
    # a drain left pending by the previous release: its pickled progress is read (restricted) and converted
    (d / "progress.pkl").write_bytes(pickle.dumps({"begun": True, "threads": 2, "files": {"__0_0.distcp": (storage, sums, 108)}}))
    old = load_progress(d)
    assert old.begun and old.threads == 2 and decode_file(old.files["__0_0.distcp"]) == (storage, sums, 108)
    save_progress(d, prog)  # the JSON record wins over the old pickle from now on
    assert load_progress(d) == prog
    (d / "progress.json").write_text(json.dumps({"version": 2}))
    with pytest.raises(IncompatibleCheckpointError, match="has version 2"):
        load_progress(d)
    assert StoredItem.from_dict(fr.items[0].to_dict(), "x") == fr.items[0]
    assert isinstance(fr, FileResult)


def test_exceptions_are_classified_by_class() -> None:
    from gemini_dcp.persistent.drain.server import classify
    from gemini_dcp.persistent.side_files import UntrustedSideFileError
    from gemini_dcp.persistent.store import PersistentChecksumError

    assert classify(ChecksumMismatchError("slot reused"))[0] == "abandon"
    assert classify(UntrustedDataError("planted"))[0] == "abandon"
    assert classify(UntrustedSideFileError("planted marker"))[0] == "abandon"
    assert classify(FileNotFoundError(2, "gone", "/x/persist/stage/step-1/rank-00000.bin"))[0] == "abandon"
    assert classify(PersistentChecksumError("store returned bad bytes"))[0] == "retry"
    assert classify(TimeoutError("store call did not finish"))[0] == "retry"


def test_the_face_names_the_drain_api() -> None:
    import gemini_dcp.persistent.drain as face

    for name in ("Drainer", "Paths", "drain_status", "drain_summary", "server_pid", "wait_idle", "ensure_server",
                 "write_request", "read_config", "serve", "main"):
        assert getattr(face, name) is not None, name
    from gemini_dcp.persistent.drain.client import server_command

    cmd = server_command("/p", DrainOptions())
    assert cmd[1:4] == ["-m", "gemini_dcp.persistent.drain.server", "/p"] and "-c" not in cmd


def test_server_starts_by_module_name_without_torch(tmp_path: Path) -> None:
    """The detached server: `python -m ...server` with the trainer's options; no torch at startup,
    no second identity of the module (runpy would warn), and a request of another release is
    abandoned with the reason, never uploaded."""
    p = Paths(tmp_path / "persist")
    p.requests.mkdir(parents=True)
    p.request(7).write_text(json.dumps({**_request(step=7).to_dict(), "version": 99}))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    opts = DrainOptions(idle_s=0.0, nice=0)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-W", "error::RuntimeWarning", "-c",
         "import runpy, sys; sys.argv[0] = 'server'; runpy.run_module('gemini_dcp.persistent.drain.server', "
         "run_name='__main__', alter_sys=True); print('TORCH' if 'torch' in sys.modules else 'LIGHT')",
         str(p.dir), "--options", opts.to_json()],
        env=env, capture_output=True, text=True, timeout=120, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("LIGHT"), proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "gemini_dcp.persistent.drain.server" not in imported  # run as __main__ only: one identity
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    status = drain_status(p.dir)
    assert status["pending"] == [] and status["steps"]["7"]["state"] == "abandoned"
    assert "version 99" in status["steps"]["7"]["reason"]
    assert p.pid.read_text().strip().isdigit()


def test_server_help_runs_by_module_name() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "gemini_dcp.persistent.drain.server", "--help"],
                          env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0 and "persist_dir" in proc.stdout, proc.stderr
