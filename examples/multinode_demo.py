"""Multi-node recovery from peer memory, simulated on one machine.

Starts ``--nodes`` simulated nodes (default 3), each one ``torchrun`` agent with
``--nnodes N --node-rank i`` joined by a c10d rendezvous on 127.0.0.1, each with its
own tier root (``GEMINI_DCP_ROOT=<base>/node<i>``: its "CPU memory"), training
``examples/train_fsdp2.py`` with ``--replicas 2`` (every node's shards also live in a
peer node's memory, GEMINI mixed placement).

At ``--fail-at-step`` the last node goes down: its workers SIGKILL their torchrun
agent and themselves (the demo then SIGKILLs anything of that node still alive), and
its tier root is wiped — the machine and its memory are gone. A replacement node
(a fresh agent, empty root, same node rank) joins the rendezvous; the survivors'
agents restart their workers; everyone resumes from the newest step, the
replacement pulling its shards from peer memory::

    python examples/multinode_demo.py                     # 3 nodes x 1 rank, kill node 2 at step 6
    python examples/multinode_demo.py --nodes 2 --nproc-per-node 2 --verify

``--verify`` also runs the same training without any failure (one standalone
torchrun with the same world size) and checks that the final parameters hash equal.
Exit status 0 only if the job finished and restored bytes from the peer tier.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_fsdp2.py"
MODEL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--batch", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One simulated node: a torchrun agent (and its workers) with its own tier root."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: list[str]) -> None:
        self.name, self.log = name, log
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.pids: set[int] = {self.proc.pid}
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if _noise(line):
                continue
            self.log.append(f"[{self.name}] {line}")
            print(f"[{self.name}] {line}", flush=True)

    def track(self) -> None:
        """Remember the agent's worker pids (to SIGKILL leftovers once the node is 'down')."""
        try:
            import psutil

            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.pids.add(child.pid)
        except Exception:  # noqa: BLE001 - best effort; the agent may be gone already
            pass

    def kill_all(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: float | None = None) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc


def _noise(line: str) -> bool:
    return bool(re.match(r"^W\d{4} .*(\*{10}|OMP_NUM_THREADS|run.py:\d+\] *$)", line)) or "Warning" in line


def agent_cmd(args: argparse.Namespace, node_rank: int, port: int, run_id: str, train_args: list[str],
              host_store: bool) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(args.nodes), "--node-rank", str(node_rank), "--nproc-per-node", str(args.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={'true' if host_store else 'false'},join_timeout=300",
        "--max-restarts", "3", "--monitor-interval", "0.1",
        str(TRAIN), *MODEL, "--steps", str(args.steps), "--replicas", str(args.replicas), "--job-id", run_id,
        *train_args,
    ]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    # Fresh rendezvous store per restart round (torchrun shares one without per-attempt prefixes).
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_reference(args: argparse.Namespace, base: Path) -> str | None:
    """The same training, no failure, one standalone torchrun with the same world size."""
    env = base_env()
    env["GEMINI_DCP_ROOT"] = str(base / "reference")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(args.nodes * args.nproc_per_node), str(TRAIN), *MODEL,
           "--steps", str(args.steps), "--ckpt-backend", "none", "--print-params-hash"]
    print("== reference run (no failure):", " ".join(cmd[3:]), flush=True)
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=600)
    m = re.search(r"final params sha256 ([0-9a-f]+)", out.stdout + out.stderr)
    return m.group(1) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="simulated nodes (2-3 on a small machine)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fail-at-step", type=int, default=6)
    p.add_argument("--victim", type=int, default=None, help="node rank to kill (default: the last; node 0 hosts the rendezvous store)")
    p.add_argument("--base", default=None, help="directory holding the nodes' tier roots (default: a fresh one in /dev/shm)")
    p.add_argument("--replace-delay", type=float, default=0.0, help="seconds between the node's death and the replacement's start")
    p.add_argument("--verify", action="store_true", help="also run without failure and compare the final parameters")
    p.add_argument("--keep", action="store_true", help="keep the tier roots afterwards")
    args = p.parse_args(argv)
    victim = args.nodes - 1 if args.victim is None else args.victim
    if not 0 < victim < args.nodes:
        p.error("--victim must be a node rank other than 0 (node 0's agent hosts the c10d rendezvous store)")

    base = Path(args.base) if args.base else Path(tempfile.mkdtemp(prefix="gemini_multinode_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    roots = [base / f"node{i}" for i in range(args.nodes)]
    for r in roots:
        r.mkdir(parents=True, exist_ok=True, mode=0o700)
    port = free_port()
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    log: list[str] = []
    print(f"== {args.nodes} simulated nodes x {args.nproc_per_node} rank(s), replicas={args.replicas}, "
          f"rendezvous c10d 127.0.0.1:{port}, job {run_id}; tier roots under {base}", flush=True)

    nodes: dict[int, Node] = {}
    t_start = time.time()
    for i in range(args.nodes):
        env = base_env()
        env["GEMINI_DCP_ROOT"] = str(roots[i])
        extra = ["--print-params-hash"]
        if i == victim:
            extra += ["--fail-at-step", str(args.fail_at_step), "--fail-mode", "node"]
        nodes[i] = Node(f"node{i}", agent_cmd(args, i, port, run_id, extra, host_store=(i == 0)), env, log)
        if i == 0:
            time.sleep(1.0)  # let node 0's agent host the rendezvous store first

    # Wait for the victim node to go down.
    victim_node = nodes[victim]
    while victim_node.proc.poll() is None:
        victim_node.track()
        if any(n.proc.poll() not in (None, 0) for i, n in nodes.items() if i != victim):
            print("== a surviving node failed before the victim went down", flush=True)
            break
        time.sleep(0.05)
    t_down = time.time()
    victim_node.kill_all()  # SIGKILL whatever of the node is still alive (agent + workers)
    time.sleep(0.2)
    victim_node.wait(timeout=30)
    shutil.rmtree(roots[victim], ignore_errors=True)  # the machine's memory is gone
    roots[victim].mkdir(mode=0o700)
    print(f"== node{victim} is down (agent rc {victim_node.proc.returncode}); its tier root {roots[victim]} was wiped", flush=True)
    if args.replace_delay:
        time.sleep(args.replace_delay)
    env = base_env()
    env["GEMINI_DCP_ROOT"] = str(roots[victim])
    print(f"== starting replacement node{victim} (fresh agent, empty memory)", flush=True)
    nodes[victim] = Node(f"node{victim}'", agent_cmd(args, victim, port, run_id, ["--print-params-hash"], host_store=False), env, log)

    rcs = {}
    for i, n in nodes.items():
        try:
            rcs[i] = n.wait(timeout=900)
        except subprocess.TimeoutExpired:
            n.kill_all()
            rcs[i] = -1
    elapsed = time.time() - t_start

    text = "\n".join(log)
    resumed = re.findall(r"resumed from step (\d+) \(tier: ([^)]*)\) in ([0-9.]+) s", text)
    hashes = set(re.findall(r"final params sha256 ([0-9a-f]+)", text))
    print("\n== summary")
    print(f"node{victim} killed at step {args.fail_at_step}; replacement started {time.time() - t_down:.1f} s ago; "
          f"job took {elapsed:.1f} s; agents exit codes {rcs}")
    for step, tiers, secs in resumed:
        print(f"resumed from step {step} (tier: {tiers}) in {secs} s")
    ok = all(rc == 0 for rc in rcs.values()) and bool(resumed) and any("peer" in t for _, t, _ in resumed)
    if not ok:
        print("FAILED: the job did not finish or did not restore from peer memory", flush=True)
    if args.verify and ok:
        ref = run_reference(args, base)
        same = ref is not None and hashes == {ref}
        print(f"final parameters {'==' if same else '!='} failure-free run ({sorted(hashes)} vs {ref})")
        ok = ok and same
    if not args.keep and not args.base:
        shutil.rmtree(base, ignore_errors=True)
    print("multinode demo OK" if ok else "multinode demo FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
