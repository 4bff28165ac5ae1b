"""The options tree (gemini_dcp.options): validation messages, from_env, the writer's and reader's
``options=`` merged with their keywords, and that only gemini_dcp/options reads GEMINI_DCP_* variables.

Fast: no processes, no process group.
"""

from __future__ import annotations

import ast
import math
import os
import re
import signal
from pathlib import Path

import pytest

from gemini_dcp.errors import ConfigError
from gemini_dcp.options import (
    DrainOptions,
    GeminiOptions,
    IncrementalOptions,
    LocalOptions,
    PeerOptions,
    PersistentOptions,
    resolve_options,
)
from gemini_dcp.options.faults import fault_settings, parse_fault

REPO = Path(__file__).resolve().parents[1]


# ---- validation ----------------------------------------------------------------------------------
def test_gemini_options_is_the_one_options_type() -> None:
    import gemini_dcp.options as options

    assert not hasattr(options, "TierOptions") and not hasattr(GeminiOptions, "tier_options")
    with pytest.raises(ConfigError, match=r"keep=0: keep at least 1 committed step \(default 2\)"):
        GeminiOptions().with_keywords(keep=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LocalOptions(keep=0), r"keep=0: keep at least 1 committed step"),
        (lambda: LocalOptions(keep=True), r"keep=True"),
        (lambda: LocalOptions(root=3), r"root=3 is a int, not a path"),
        (lambda: LocalOptions(job_id="a/b"), r"job_id 'a/b' is not usable as a directory name"),
        (lambda: LocalOptions(node_id=" "), r"node_id=' ': give a non-empty string"),
        (lambda: LocalOptions(checksum="md5"), r"checksum='md5': choose 'auto'"),
        (lambda: LocalOptions(capacity_bytes=0), r"capacity_bytes=0: give a positive byte budget"),
        (lambda: PeerOptions(replicas=0), r"replicas=0: replicas counts the node's own copy"),
        (lambda: PeerOptions(placement="star"), r"placement='star': choose 'mixed'"),
        (lambda: PeerOptions(on_peer_failure="ignore"), r"on_peer_failure='ignore': choose 'raise'"),
        (lambda: PeerOptions(parity_group=2), r"parity_group=2: pass an int >= 3"),
        (lambda: PeerOptions(parity_group=True), r"parity_group=True: pass an int >= 3"),
        (lambda: PeerOptions(parity_group=4, replicas=2), r"parity_group=4 and replicas=2 both protect the peer tier: choose one"),
        (lambda: IncrementalOptions(enabled="yes"), r"incremental='yes': pass True or False"),
        (lambda: IncrementalOptions(enabled=True, full_every=0), r"full_every=0: pass a positive int"),
        (lambda: IncrementalOptions(enabled=True, full_every=2.5), r"full_every=2.5: pass a positive int"),
        (lambda: IncrementalOptions(full_every=3), r"full_every=3 only applies to incremental saves: pass incremental=True"),
        (lambda: GeminiOptions(incremental=True), r"incremental=True: give a IncrementalOptions"),
        (lambda: PersistentOptions(every=0), r"persist_every=0: drain every K-th step"),
        (lambda: PersistentOptions(keep=0), r"persist_keep=0: give an int >= 1, or None"),
        (lambda: PersistentOptions(url=" "), r"persistent=' ': give the fsspec URL"),
        (lambda: PersistentOptions(timeout_s=-1), r"persistent timeout_s=-1: give a positive, finite number"),
        (lambda: PersistentOptions(drain={"threads": 2}), r"give a DrainOptions"),
        (lambda: DrainOptions(mode="fork"), r"drain mode='fork': choose 'process'"),
        (lambda: DrainOptions(threads=0), r"drain threads=0: .*GEMINI_DCP_DRAIN_THREADS"),
        (lambda: DrainOptions(attempts=0), r"drain attempts=0: .*GEMINI_DCP_DRAIN_ATTEMPTS"),
        (lambda: DrainOptions(idle_s=-1), r"drain idle_s=-1: .*GEMINI_DCP_DRAIN_IDLE_S"),
        (lambda: DrainOptions(nice=40), r"drain nice=40: give a niceness -20..19"),
        (lambda: DrainOptions(peer_timeout_s=math.inf), r"drain peer_timeout_s=inf"),
        (lambda: GeminiOptions(timeout_s=0), r"timeout_s=0: give a positive, finite number of seconds"),
        (lambda: GeminiOptions(peer=LocalOptions()), r"peer=.*give a PeerOptions"),
    ],
)
def test_validation_says_what_to_fix(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()  # type: ignore[operator]


def test_options_are_frozen_slotted_and_keyword_only() -> None:
    for cls in (LocalOptions, PeerOptions, PersistentOptions, DrainOptions, GeminiOptions, IncrementalOptions):
        assert "__slots__" in cls.__dict__, cls
        with pytest.raises(TypeError):
            cls(1)  # type: ignore[misc]  # keyword-only
    o = DrainOptions()
    with pytest.raises(AttributeError):
        o.threads = 3  # type: ignore[misc]
    assert DrainOptions(throttle_bps=0).throttle_bps is None  # 0 means no cap, as the variable says


# ---- from_env -------------------------------------------------------------------------------------
def test_from_env_reads_the_tier_and_drain_variables() -> None:
    env = {
        "GEMINI_DCP_ROOT": "/tmp/gemroot", "GEMINI_DCP_NODE_ID": "node-7", "GEMINI_DCP_DRAIN_MODE": "Thread",
        "GEMINI_DCP_DRAIN_IDLE_S": "3", "GEMINI_DCP_DRAIN_THROTTLE_BPS": "1024", "GEMINI_DCP_DRAIN_PEER_TIMEOUT_S": "5",
        "GEMINI_DCP_DRAIN_NICE": "idle", "GEMINI_DCP_DRAIN_THREADS": "4", "GEMINI_DCP_DRAIN_ATTEMPTS": "1",
    }
    o = GeminiOptions.from_env(env, replicas=2)
    assert o.local.root == "/tmp/gemroot" and o.local.node_id == "node-7"
    assert o.peer.replicas == 2
    assert o.persistent.drain == DrainOptions(
        mode="thread", idle_s=3.0, throttle_bps=1024.0, peer_timeout_s=5.0, nice="idle", threads=4, attempts=1
    )
    assert GeminiOptions.from_env(env, root="/elsewhere").local.root == "/elsewhere"  # keywords win over the environment
    empty = GeminiOptions.from_env({})
    assert empty == GeminiOptions() and empty.persistent.drain.resolved_mode("memory") == "thread"
    assert empty.persistent.drain.resolved_mode("file") == "process"
    assert DrainOptions.from_env({"GEMINI_DCP_DRAIN_NICE": "5"}).nice == 5


def test_from_env_reads_incremental_and_parity_variables() -> None:
    o = GeminiOptions.from_env({"GEMINI_DCP_INCREMENTAL": "yes", "GEMINI_DCP_FULL_EVERY": "8", "GEMINI_DCP_PARITY_GROUP": "4"})
    assert o.incremental == IncrementalOptions(enabled=True, full_every=8) and o.peer.parity_group == 4
    assert GeminiOptions.from_env({"GEMINI_DCP_INCREMENTAL": "1"}).incremental == IncrementalOptions(enabled=True)
    # keywords win over the environment, and are validated together with it
    assert GeminiOptions.from_env({"GEMINI_DCP_INCREMENTAL": "1"}, full_every=3).incremental.full_every == 3
    assert GeminiOptions.from_env({"GEMINI_DCP_PARITY_GROUP": "3"}, parity_group=5).peer.parity_group == 5
    with pytest.raises(ConfigError, match=r"parity_group=3 and replicas=2 both protect"):
        GeminiOptions.from_env({"GEMINI_DCP_PARITY_GROUP": "3"}, replicas=2)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GEMINI_DCP_INCREMENTAL", "maybe", r"GEMINI_DCP_INCREMENTAL='maybe' is not a flag; set it to 1 or 0"),
        ("GEMINI_DCP_FULL_EVERY", "0", r"GEMINI_DCP_FULL_EVERY='0' is below 1"),
        ("GEMINI_DCP_FULL_EVERY", "5", r"GEMINI_DCP_FULL_EVERY=5 only applies to incremental saves: set GEMINI_DCP_INCREMENTAL=1"),
        ("GEMINI_DCP_PARITY_GROUP", "2", r"GEMINI_DCP_PARITY_GROUP='2' is below 3"),
        ("GEMINI_DCP_PARITY_GROUP", "four", r"GEMINI_DCP_PARITY_GROUP='four' is not an integer"),
        ("GEMINI_DCP_DRAIN_THREADS", "two", r"GEMINI_DCP_DRAIN_THREADS='two' is not an integer"),
        ("GEMINI_DCP_DRAIN_THREADS", "0", r"GEMINI_DCP_DRAIN_THREADS='0' is below 1"),
        ("GEMINI_DCP_DRAIN_MODE", "fork", r"GEMINI_DCP_DRAIN_MODE='fork' is not one of process, thread"),
        ("GEMINI_DCP_DRAIN_IDLE_S", "soon", r"GEMINI_DCP_DRAIN_IDLE_S='soon' is not a number"),
        ("GEMINI_DCP_DRAIN_NICE", "low", r"GEMINI_DCP_DRAIN_NICE='low' is not an integer"),
        ("GEMINI_DCP_DRAIN_NICE", "25", r"GEMINI_DCP_DRAIN_NICE='25' is above 19"),
    ],
)
def test_a_bad_variable_is_named_with_its_fix(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GeminiOptions.from_env({name: value})


def test_fault_settings_parse_and_refuse() -> None:
    assert fault_settings({}) is None
    spec = parse_fault("save.mid_copy@2:SIGTERM/1")
    assert (spec.phase, spec.nth, spec.sig, spec.rank) == ("save.mid_copy", 2, int(signal.SIGTERM), 1)
    assert parse_fault("drain.mid_upload").sig == int(signal.SIGKILL)
    settings = fault_settings({"GEMINI_DCP_FAULT_LOG": "/tmp/x"})
    assert settings is not None and settings.spec is None and settings.log_dir == "/tmp/x"
    with pytest.raises(ConfigError, match=r"GEMINI_DCP_FAULT='save@x': write <phase>"):
        fault_settings({"GEMINI_DCP_FAULT": "save@x"})


# ---- options= and the keywords --------------------------------------------------------------------
def test_resolve_options_merges_keywords_and_refuses_conflicts() -> None:
    o = GeminiOptions(local=LocalOptions(keep=3), peer=PeerOptions(replicas=2))
    assert resolve_options(o, keep=2, replicas=1) == o  # keywords at their defaults take the options' values
    assert resolve_options(o, replicas=2).peer.replicas == 2  # the same value in both places is no conflict
    merged = resolve_options(o, placement="ring", persistent="file:///s", persist_every=5)
    assert merged.peer.placement == "ring" and merged.persistent.url == "file:///s" and merged.persistent.every == 5
    assert merged.local.keep == 3
    with pytest.raises(ConfigError, match=r"replicas=3 conflicts with options.peer.replicas=2"):
        resolve_options(o, replicas=3)
    with pytest.raises(ConfigError, match=r"timeout_s=5 conflicts with options.timeout_s=9.0"):
        resolve_options(GeminiOptions(timeout_s=9.0), timeout_s=5)
    with pytest.raises(ConfigError, match=r"replicas=True"):
        resolve_options(None, replicas=True)  # a bool is not taken for the default 1
    with pytest.raises(ConfigError, match=r"give a gemini_dcp.options.GeminiOptions"):
        resolve_options({"keep": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"colour= is not an option"):
        resolve_options(None, colour="blue")
    inc = GeminiOptions(incremental=IncrementalOptions(enabled=True, full_every=4), peer=PeerOptions(parity_group=3))
    assert resolve_options(inc, incremental=False, full_every=None, parity_group=None) == inc  # defaults: the options'
    assert resolve_options(None, incremental=True, full_every=2).incremental == IncrementalOptions(enabled=True, full_every=2)
    with pytest.raises(ConfigError, match=r"full_every=9 conflicts with options.incremental.full_every=4"):
        resolve_options(inc, full_every=9)
    with pytest.raises(ConfigError, match=r"full_every=2 only applies to incremental saves"):
        resolve_options(None, full_every=2)


def test_resolve_options_without_options_takes_the_drain_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_ATTEMPTS", "3")
    assert resolve_options(None, keep=4, persistent="file:///s").persistent.drain.attempts == 3
    monkeypatch.setenv("GEMINI_DCP_DRAIN_ATTEMPTS", "many")
    with pytest.raises(ConfigError, match="GEMINI_DCP_DRAIN_ATTEMPTS"):
        resolve_options(None, persistent="file:///s")
    assert resolve_options(None, keep=4).persistent.drain == DrainOptions()  # no store: the drain settings are unused


def test_writer_and_reader_take_options(tmp_path: Path) -> None:
    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    opts = GeminiOptions(local=LocalOptions(root=str(root), job_id="opt", keep=3, node_id="n0"), timeout_s=30.0)
    w = GeminiStorageWriter(options=opts)
    assert (w.options.local.keep, w.options.timeout_s, w.job_id, w.node_id) == (3, 30.0, "opt", "n0")
    assert w.root == root and w.options == opts  # the keywords build the tree; the writer holds it
    w2 = GeminiStorageWriter(replicas=2, options=GeminiOptions(local=LocalOptions(root=str(root), job_id="opt2")))
    assert w2.options.peer.replicas == 2 and w2.job_id == "opt2"
    r = GeminiStorageReader(options=opts)
    assert (r.timeout_s, r.job_id, r.node_id, r.root) == (30.0, "opt", "n0", root) and r.options == opts
    inc = GeminiOptions(local=LocalOptions(root=str(root), job_id="opt3"), incremental=IncrementalOptions(enabled=True, full_every=5))
    w3 = GeminiStorageWriter(options=inc)
    assert w3.options.incremental == IncrementalOptions(enabled=True, full_every=5) and w3.local_writer.carry is not None
    w4 = GeminiStorageWriter(options=GeminiOptions(local=LocalOptions(root=str(root), job_id="opt4"), peer=PeerOptions(parity_group=3)))
    assert w4.options.peer.parity_group == 3


def test_a_conflict_or_bad_value_fails_before_any_directory_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    opts = GeminiOptions(local=LocalOptions(root=str(root), keep=3))
    with pytest.raises(ConfigError, match=r"keep=5 conflicts with options.local.keep=3"):
        GeminiStorageWriter(job_id="c", keep=5, options=opts)
    with pytest.raises(ConfigError, match=r"root=.* conflicts with options.local.root"):
        GeminiStorageReader(root=str(tmp_path), options=opts)
    with pytest.raises(ConfigError, match=r"parity_group=3 and replicas=2"):
        GeminiStorageWriter(root=str(root), job_id="c", replicas=2, parity_group=3)
    with pytest.raises(ConfigError, match=r"full_every=4 only applies to incremental saves"):
        GeminiStorageWriter(root=str(root), job_id="c", full_every=4)
    monkeypatch.setenv("GEMINI_DCP_DRAIN_THREADS", "-1")
    with pytest.raises(ConfigError, match="GEMINI_DCP_DRAIN_THREADS"):
        GeminiStorageWriter(root=str(root), job_id="c", persistent=f"file://{tmp_path / 'store'}")
    assert os.listdir(root) == [] and not (tmp_path / "store").exists()


# ---- the only reader ------------------------------------------------------------------------------
_VARIABLE = re.compile(r"^GEMINI_DCP_[A-Z0-9_]+$")
# gemini_dcp/ext reads its own variables through gemini_dcp/options/ext.py (the extension's part of the tree).
_OUTSIDE_THIS_TREE = ("gemini_dcp/ext/",)


def test_only_gemini_dcp_options_names_a_gemini_dcp_variable() -> None:
    """A string literal that is exactly a variable name (what an environment read needs) appears
    only under gemini_dcp/options/; messages and docstrings may mention them."""
    found = []
    files = sorted((REPO / "gemini_dcp").rglob("*.py")) + sorted((REPO / "cli").rglob("*.py"))
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("gemini_dcp/options/") or rel.startswith(_OUTSIDE_THIS_TREE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _VARIABLE.match(node.value):
                found.append(f"{rel}:{node.lineno}: {node.value}")
            if isinstance(node, ast.Call) and "environ" in ast.unparse(node.func) or (
                isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ")
            ):
                text = ast.unparse(node)
                if "GEMINI_DCP" in text or "ENV_" in text:
                    found.append(f"{rel}:{node.lineno}: {text}")
    assert not found, "read GEMINI_DCP_* variables through gemini_dcp.options:\n" + "\n".join(found)


def test_device_options_from_env_and_their_errors() -> None:
    from gemini_dcp.options.device import DeviceOptions

    assert DeviceOptions.from_env({}) == DeviceOptions()
    o = DeviceOptions.from_env({"GEMINI_DCP_D2H_CHECKSUM": "CPU", "GEMINI_DCP_H2D_REGISTER": "0"})
    assert o.d2h_checksum == "cpu" and o.h2d_register == "never"
    assert DeviceOptions.from_env({"GEMINI_DCP_H2D_REGISTER": "1"}).h2d_register == "always"
    with pytest.raises(ConfigError, match="GEMINI_DCP_D2H_CHECKSUM='fast'.*auto, gpu or cpu"):
        DeviceOptions.from_env({"GEMINI_DCP_D2H_CHECKSUM": "fast"})
    with pytest.raises(ConfigError, match="GEMINI_DCP_H2D_REGISTER='maybe'"):
        DeviceOptions.from_env({"GEMINI_DCP_H2D_REGISTER": "maybe"})
    with pytest.raises(ConfigError, match="d2h_checksum"):
        DeviceOptions(d2h_checksum="tpu")  # type: ignore[arg-type]


def test_exit_wait_reads_its_variable_and_never_raises() -> None:
    from gemini_dcp.options.process import EXIT_WAIT_S, exit_wait_s

    assert exit_wait_s({}) == EXIT_WAIT_S
    assert exit_wait_s({"GEMINI_DCP_EXIT_WAIT_S": "0"}) == 0.0
    assert exit_wait_s({"GEMINI_DCP_EXIT_WAIT_S": "0.5"}) == 0.5
    assert exit_wait_s({"GEMINI_DCP_EXIT_WAIT_S": "soon"}) == EXIT_WAIT_S  # an exit hook must not raise
    assert exit_wait_s({"GEMINI_DCP_EXIT_WAIT_S": "-1"}) == EXIT_WAIT_S
