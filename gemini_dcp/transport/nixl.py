"""The NIXL engine: peer-tier bytes as one-sided NIXL WRITEs, over UCX (RDMA, shared memory, TCP).

This module holds this process's NIXL agent and its transfers in flight; the transport class
over it, :class:`~gemini_dcp.transport.p2p.NixlTransport` (deadlines, errors, pacing), is a
:class:`~gemini_dcp.transport.p2p.Transport` (chosen with
``peer_transport="nixl"``, or ``"auto"`` where NIXL imports and its UCX backend starts:
:func:`~gemini_dcp.transport.p2p.transport_for`). It keeps the message pairing of the
gloo transport, so the peer tier's modules (replication, lost-node restore, parity,
deltas) post exactly what they post over gloo:

1. **post_recv** registers the caller's buffer with this process's NIXL agent and sends
   the sender a *descriptor* (a random token, the buffer's address and length, and the
   agent's partial metadata for that buffer, connection info included) as one small gloo
   message on the control group: no new rendezvous, no port beyond UCX's own.
2. **post_send** posts the gloo receive of that descriptor. The k-th send from A to B meets
   the k-th receive of B from A, as gloo point-to-point messages between a pair are ordered.
3. **progress**: a send whose descriptor arrived loads the peer's metadata, registers its own
   buffer and posts one WRITE of it straight into the receiver's buffer, carrying the token as
   its notification; a finished WRITE releases its registration. The thread that received the
   descriptor posts and drives an unpaced send at once (:func:`_serve`), so a serving rank's
   bytes move while its own thread works (a restore verifying its local chunks); every wait of
   the transport also runs :meth:`NixlEngine.progress`, whatever it waits for.
4. **wait** (the transport's) on a receive waits for the token's notification (NIXL delivers
   it after the WRITE's bytes); on a send, for the WRITE's completion. Every wait is bounded by its
   deadline (the group's ``timeout_s`` when none is given): a peer killed or stopped
   mid-transfer ends in :class:`~gemini_dcp.errors.PeerError` (or, ``fatal``,
   :class:`~gemini_dcp.errors.RestartRequiredError`), and the caller's usual fallback runs.

Bytes are verified by the callers against the step record's checksums on arrival, as over gloo.
A paced send (``send_ranges`` with ``pace``) writes its range in the
``wire_chunk`` pieces the pacer sizes, the last one carrying the notification; unpaced,
a whole range is one WRITE (the receiver always posts one receive per range).

Tokens are random per transfer, so a late notification of a failed transfer never completes
a later one. A WRITE still in flight when its wait gave up may land after it, as a late gloo
message may; the writer replaces the control group and the slot is not committed.

Registration is per transfer (cheap over UCX shared memory and TCP, which pin nothing:
docs/benchmarks.md); registering the slot mappings once per writer is the next step, for RDMA
NICs, where registration pins pages. gloo's receive work reports completion only to a blocking ``wait``, so
one daemon thread per peer blocks on that peer's descriptors in turn
(:meth:`NixlEngine.await_descriptor`). NIXL's own progress thread is off (it polls without pause
and takes a core). The agent starts with UCX's memory-event hooks off (:data:`UCX_DEFAULTS`,
unless the environment sets them): NIXL hands UCX its registrations explicitly, so the hooks
only feed UCX's registration and memory-type caches, and installing them took most of the
agent's start.
The ``nixl`` module (or the ``nixl_cu12`` / ``nixl_cu13`` wheel's) is imported only here,
lazily: ``import gemini_dcp`` never needs it. One agent per process (:func:`engine`), created
on first use or ahead by :func:`prestart`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..core.faults import fault_point

__all__ = [
    "DESC_BYTES", "NIXL_MODULES", "SERVE_DRIVE_S", "UCX_DEFAULTS", "NixlEngine", "RecvOp", "SendOp", "describe", "engine",
    "landed", "load_nixl", "prestart", "probe",
    "received", "ucx_transports",
]

log = logging.getLogger(__name__)

#: Where NIXL's Python API may be installed: the ``nixl`` meta package, or one CUDA variant's wheel.
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
#: Bytes of one descriptor message (header + the receiver's partial agent metadata).
DESC_BYTES = 8192
#: How long a descriptor waiter thread drives a send it posted before leaving it to the waits (s).
SERVE_DRIVE_S = 5.0
#: UCX settings NIXL's agent starts with unless the environment sets them (:func:`engine`).
UCX_DEFAULTS = {"UCX_MEM_EVENTS": "no"}
_MAGIC = 0x4E49584C44435031  # "NIXLDCP1"
_HEADER = 5  # int64s: magic, token, address, length, metadata length


def load_nixl() -> ModuleType:
    """NIXL's Python API (the first of :data:`NIXL_MODULES` that imports); ImportError naming each try."""
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
        errors.append(f"{name}: no nixl_agent")
    raise ImportError("NIXL is not installed (" + "; ".join(errors) + "). Install it with "
                      "`pip install --no-deps nixl-cu12 numpy` (see docs/deploying.md).")


def describe() -> dict[str, Any]:
    """What this host has for ``peer_transport="nixl"`` (``gemini-dcp doctor``): NIXL's module and
    version, the UCX transport modules its wheel ships, ``UCX_TLS`` / ``UCX_NET_DEVICES``, RDMA
    devices, whether an agent with the UCX backend starts here, and what ``"auto"`` would pick."""
    out: dict[str, Any] = {"installed": False, "module": None, "version": None, "ucx_modules": [],
                           "ucx_tls": ucx_transports(), "ucx_net_devices": os.environ.get("UCX_NET_DEVICES") or "all",
                           "rdma_devices": sorted(p.name for p in Path("/sys/class/infiniband").glob("*")),
                           "backend": "", "auto": "gloo"}
    try:
        mod = load_nixl()
    except ImportError as exc:
        out["backend"] = str(exc)
        return out
    out.update(installed=True, module=mod.__name__)
    for dist_name in (mod.__name__.replace("_", "-"), "nixl"):
        try:
            out["version"] = importlib.metadata.version(dist_name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    libs = Path(mod.__file__ or ".").parent.parent / f"{mod.__name__}.libs" / "ucx"
    names = {p.name.split(".so")[0].removeprefix("libuct_") for p in libs.glob("libuct_*.so*")}
    out["ucx_modules"] = sorted({"self", "sm (posix, sysv)", "tcp"} | names)
    ok, why = probe()
    out["backend"] = why
    out["auto"] = "nixl" if ok else "gloo"
    return out


def ucx_transports() -> str:
    """The UCX transports NIXL's UCX backend may use: ``$UCX_TLS``, or UCX's own choice."""
    return os.environ.get("UCX_TLS", "").strip() or "all (UCX chooses; set UCX_TLS)"


class NixlEngine:
    """This process's NIXL agent (UCX backend) and its transfers in flight (see the module docstring)."""

    def __init__(self, mod: ModuleType, agent: Any, name: str) -> None:
        self.mod = mod
        self.agent = agent
        self.name = name
        self.lock = threading.RLock()  # agent calls, ``arrived`` and the ops' states (the agent runs without its own locks)
        self.ops_lock = threading.Lock()  # ``sends`` and the waiters: posting never waits for a WRITE in flight
        self.sends: list[SendOp] = []  # posted sends, progressed by every wait
        self.arrived: set[bytes] = set()  # tokens notified and not yet waited for
        self._waiters: dict[int, queue.SimpleQueue[SendOp]] = {}  # peer -> its descriptor waiter's queue

    def await_descriptor(self, peer: int, op: SendOp) -> None:
        """Have ``peer``'s waiter thread block on ``op``'s descriptor receive (gloo's receive work
        reports completion only to a blocking ``wait``; descriptors of one peer arrive in order)."""
        with self.ops_lock:
            q = self._waiters.get(peer)
            if q is None:
                q = self._waiters[peer] = queue.SimpleQueue()
                threading.Thread(target=_wait_descriptors, args=(self, q), name=f"gemini-dcp-nixl-desc-{peer}",
                                 daemon=True).start()
        q.put(op)

    def post_recv(self, buf: torch.Tensor, peer: int, group: Any) -> RecvOp:
        """Register ``buf`` (contiguous) and send ``peer`` its descriptor over ``group`` (step 1 of the
        module docstring). Raises what NIXL or gloo raise."""
        n = buf.numel() * buf.element_size()
        if n == 0:
            return RecvOp(b"", None, None, 0)
        if not buf.is_contiguous():
            raise ValueError("NIXL receives into contiguous buffers only")
        token = secrets.randbits(62) | 1
        with self.lock:
            reg = self.register(buf)
            md = bytes(self.agent.get_partial_agent_metadata(reg, True))
        if len(md) > DESC_BYTES - _HEADER * 8:
            self.release(reg)
            raise RuntimeError(f"NIXL metadata of {len(md)} bytes exceeds the {DESC_BYTES}-byte descriptor")
        desc = torch.zeros(DESC_BYTES, dtype=torch.uint8)
        desc[: _HEADER * 8] = torch.tensor([_MAGIC, token, buf.data_ptr(), n, len(md)], dtype=torch.int64).view(torch.uint8)
        desc[_HEADER * 8 : _HEADER * 8 + len(md)] = torch.frombuffer(bytearray(md), dtype=torch.uint8)
        fault_point("nixl.exchange")  # registered, the descriptor not yet sent
        try:
            work = dist.isend(desc, dst=peer, group=group)
        except BaseException:
            self.release(reg)
            raise
        return RecvOp(token.to_bytes(8, "little"), reg, work, n)

    def post_send(self, buf: torch.Tensor, peer: int, group: Any, *, auto: bool = True) -> SendOp:
        """Post the receive of ``peer``'s descriptor for a send of ``buf`` (step 2); with ``auto``,
        progress WRITEs it whole once the descriptor arrives, else the caller does (:meth:`SendOp.write`)."""
        flat = buf.reshape(-1).view(torch.uint8) if buf.numel() else buf
        if flat.numel() == 0:
            return SendOp(flat, None, None)
        if not buf.is_contiguous():
            raise ValueError("NIXL sends from contiguous buffers only")
        desc = torch.empty(DESC_BYTES, dtype=torch.uint8)
        op = SendOp(flat, desc, dist.irecv(desc, src=peer, group=group))
        op.auto = auto
        with self.ops_lock:
            self.sends.append(op)
        self.await_descriptor(peer, op)
        return op

    def abandon(self, op: RecvOp | SendOp) -> None:
        """Stop progressing ``op`` after its wait gave up (its receive buffer is deregistered)."""
        with self.lock:
            if isinstance(op, SendOp):
                with self.ops_lock:
                    if op in self.sends:
                        self.sends.remove(op)
                if op.error is None:
                    op.fail(TimeoutError("abandoned"))
            elif op.reg is not None:
                self.release(op.reg)
                op.reg = None

    def register(self, buf: torch.Tensor) -> Any:
        return self.agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")

    def release(self, reg: Any) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as exc:  # noqa: BLE001 - cleanup: a failed deregistration only leaks the registration
            log.debug("NIXL deregistration failed: %s", exc)

    def poll_notifs(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            self.arrived.update(bytes(m) for m in msgs)

    def progress(self) -> None:
        """Advance every posted send one step (descriptor arrived -> WRITE posted -> WRITE done)."""
        with self.lock:
            with self.ops_lock:
                ops = list(self.sends)
            for op in ops:
                op.advance(self)
            with self.ops_lock:
                self.sends = [op for op in self.sends if op.state not in ("done", "error")]
            self.poll_notifs()


def _wait_descriptors(eng: NixlEngine, q: queue.SimpleQueue[SendOp]) -> None:
    """A descriptor waiter: block on each queued send's descriptor receive in turn (GIL released),
    then serve it (:func:`_serve`)."""
    while True:
        op = q.get()
        try:
            op.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the op's wait
            op.desc_error = exc
        op.arrived.set()
        if op.auto and op.desc_error is None:
            _serve(eng, op)


def _serve(eng: NixlEngine, op: SendOp) -> None:
    """Post ``op``'s WRITE as soon as its descriptor arrived and drive it until it landed, for at most
    :data:`SERVE_DRIVE_S`: a serving rank's sends go out while its own thread does other work (a restore
    verifying its local chunks), not when it next waits. Past the bound (a peer gone or stopped) the
    op is left to the waits, whose deadline ends it; errors go to the op's state, as in progress."""
    t0 = time.monotonic()
    nap = 0.00002
    while True:
        with eng.lock:
            if op.state in ("done", "error"):
                return
            op.advance(eng)
            if op.state in ("done", "error"):
                return
        if time.monotonic() - t0 > SERVE_DRIVE_S:
            return
        time.sleep(nap)
        nap = min(nap * 2, 0.001)


_ENGINE: NixlEngine | None = None
_ENGINE_ERROR: str | None = None
_ENGINE_LOCK = threading.Lock()


def engine() -> NixlEngine:
    """This process's :class:`NixlEngine`, created on first call; ImportError / RuntimeError saying why not."""
    global _ENGINE, _ENGINE_ERROR
    with _ENGINE_LOCK:
        if _ENGINE is not None:
            return _ENGINE
        if _ENGINE_ERROR is not None:
            raise RuntimeError(_ENGINE_ERROR)
        mod = load_nixl()
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        name = f"gemini-dcp-r{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            agent = mod.nixl_agent(name, mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:  # noqa: BLE001 - any failure to start means "not usable here"
            _ENGINE_ERROR = f"NIXL agent could not start: {type(exc).__name__}: {exc}"
            raise RuntimeError(_ENGINE_ERROR) from exc
        if "UCX" not in getattr(agent, "backends", {}):
            _ENGINE_ERROR = f"NIXL's UCX backend did not start (UCX_TLS={ucx_transports()})"
            raise RuntimeError(_ENGINE_ERROR)
        _ENGINE = NixlEngine(mod, agent, name)
        return _ENGINE


def prestart() -> None:
    """Start this process's agent on a helper thread (not collective), so that the first transfer does
    not pay for NIXL's import and UCX's initialisation (docs/deploying.md); a failure is reported again
    by :func:`engine`."""
    if _ENGINE is not None or _ENGINE_ERROR is not None:
        return

    def start() -> None:
        try:
            engine()
        except (ImportError, RuntimeError):
            pass

    threading.Thread(target=start, name="gemini-dcp-nixl-start", daemon=True).start()


def probe() -> tuple[bool, str]:
    """Whether NIXL imports and its UCX backend starts in this process: (ok, what or why not)."""
    try:
        eng = engine()
    except (ImportError, RuntimeError) as exc:
        return False, str(exc)
    return True, f"{eng.mod.__name__} agent {eng.name} with UCX (UCX_TLS={ucx_transports()})"


class RecvOp:
    """A posted receive: registered buffer, descriptor sent, notification awaited."""

    def __init__(self, token: bytes, reg: Any, desc_work: Any, nbytes: int) -> None:
        self.token = token
        self.reg = reg
        self.desc_work = desc_work
        self.nbytes = nbytes
        self.done = nbytes == 0


class SendOp:
    """A posted send: descriptor awaited, then WRITE(s) posted, then done (or error)."""

    def __init__(self, buf: torch.Tensor, desc: torch.Tensor | None, work: Any) -> None:
        self.buf = buf
        self.desc = desc
        self.work = work
        self.state = "desc" if buf.numel() else "done"
        self.error: BaseException | None = None
        self.remote: tuple[str, int, bytes] | None = None  # (agent name, address, token)
        self.reg: Any = None
        self.xfers: list[Any] = []
        self.written = 0  # bytes whose WRITE was posted
        self.auto = True  # progress posts the whole buffer at once (False: a paced send_ranges does)
        self.arrived = threading.Event()  # the descriptor receive returned (desc_error: with an error)
        self.desc_error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        self.state, self.error = "error", exc

    def ready(self, eng: NixlEngine) -> bool:
        """Whether the receiver's descriptor arrived and was loaded (raises nothing: errors go to state)."""
        if self.remote is not None:
            return True
        if self.state != "desc" or not self.arrived.is_set():
            return False
        try:
            if self.desc_error is not None:
                raise self.desc_error
            assert self.desc is not None
            head = self.desc[: _HEADER * 8].view(torch.int64).tolist()
            magic, token, addr, nbytes, md_len = (int(v) for v in head)
            if magic != _MAGIC or nbytes != self.buf.numel() or not 0 < md_len <= DESC_BYTES - _HEADER * 8:
                raise RuntimeError(f"descriptor mismatch (magic {magic:#x}, {nbytes} bytes announced, "
                                   f"{self.buf.numel()} to send): the two ranks' messages do not pair up")
            md = self.desc[_HEADER * 8 : _HEADER * 8 + md_len].numpy().tobytes()
            name = eng.agent.add_remote_agent(md)
            self.remote = (name.decode() if isinstance(name, bytes) else str(name), addr, token.to_bytes(8, "little"))
            self.reg = eng.register(self.buf)
            self.state = "write"
        except Exception as exc:  # noqa: BLE001 - gloo failure or NIXL error: reported by wait
            self.fail(exc)
            return False
        return True

    def write(self, eng: NixlEngine, off: int, n: int, notify: bool) -> None:
        """Post the WRITE of ``buf[off:off+n]`` into the receiver's buffer at the same offset."""
        assert self.remote is not None
        name, addr, token = self.remote
        local = eng.agent.get_xfer_descs([(self.buf.data_ptr() + off, n, 0)], "DRAM")
        remote = eng.agent.get_xfer_descs([(addr + off, n, 0)], "DRAM")
        h = eng.agent.initialize_xfer("WRITE", local, remote, name, token if notify else b"")
        fault_point("nixl.transfer")  # the WRITE prepared, not posted
        if eng.agent.transfer(h) == "ERR":
            eng.agent.release_xfer_handle(h)
            raise RuntimeError("NIXL WRITE failed to post")
        self.xfers.append(h)
        self.written = off + n

    def advance(self, eng: NixlEngine) -> None:
        if self.state == "desc" and self.auto and self.ready(eng):
            try:
                self.write(eng, 0, self.buf.numel(), notify=True)
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        if self.state == "write":
            self.reap(eng)

    def reap(self, eng: NixlEngine) -> None:
        """Drop finished WRITEs; the send is done once all of its bytes were written and landed."""
        try:
            while self.xfers:
                st = eng.agent.check_xfer_state(self.xfers[0])
                if st == "PROC":
                    return
                eng.agent.release_xfer_handle(self.xfers.pop(0))
                if st != "DONE":
                    raise RuntimeError(f"NIXL WRITE ended in state {st}")
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        if self.state == "error" or self.written == self.buf.numel():
            if self.reg is not None:
                eng.release(self.reg)
                self.reg = None
            if self.state != "error":
                self.state = "done"


def landed(eng: NixlEngine, op: SendOp, end: int) -> bool:
    """Whether every WRITE of ``op`` posted so far (up to byte ``end``) has completed."""
    op.reap(eng)
    return op.state in ("done", "error") or (not op.xfers and op.written >= end)


def received(eng: NixlEngine, r: RecvOp) -> bool:
    """Whether the notification of ``r`` arrived (its registration is then released)."""
    if r.done:
        return True
    if r.token in eng.arrived:
        eng.arrived.discard(r.token)
        if r.reg is not None:
            eng.release(r.reg)
            r.reg = None
        r.done = True
        r.desc_work = None  # delivered long ago: the notification follows the WRITE the descriptor started
    return r.done


if __name__ == "__main__":  # ``gemini-dcp doctor`` runs this in a child process: a UCX crash cannot end it
    print(json.dumps(describe()))
