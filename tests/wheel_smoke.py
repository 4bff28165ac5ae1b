"""What a user who installed the wheel runs first (tests/test_wheel.py runs it inside a fresh venv,
from a folder outside the checkout). Exits non-zero, with the reason, on the first failure.

    python wheel_smoke.py WORKDIR

1. every module of gemini_dcp and its CLI imports, from the installed package;
2. two ranks (``mp.spawn``, two simulated nodes) save with ``replicas=2`` and ``persistent=file://``,
   ``wait_persisted`` returns (the installed drain server drained it), one node is wiped and both
   ranks restore bit-exact (node 1's shards from its peer);
3. the extension builds from the installed sources into a fresh cache (or, without a compiler,
   the pure-torch fallback is what ``doctor`` reports).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import socket
import sys
import time
from pathlib import Path


def import_everything() -> int:
    import gemini_dcp
    import gemini_dcp_cli

    count = 0
    for pkg in (gemini_dcp, gemini_dcp_cli):
        importlib.import_module(pkg.__name__)
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if mod.name.endswith(".__main__"):
                continue
            importlib.import_module(mod.name)
            count += 1
    return count


def _wipe(root: str) -> None:
    """Empty a node's tier root. The old node's drain may still write its last status file while the
    tree goes (a replaced machine's would not exist): retry until the removal wins."""
    for _ in range(100):
        try:
            shutil.rmtree(root)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    os.makedirs(root, 0o700, exist_ok=True)


def _rank(rank: int, port: int, roots: list[str], store: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        state = {f"w{rank}": torch.arange(1 << 16, dtype=torch.float32) * (rank + 1)}
        w = GeminiStorageWriter(root=roots[rank], job_id="smoke", replicas=2, persistent=store, persist_every=1)
        for step in (1, 2):
            dcp.save(state, storage_writer=w, checkpoint_id=step)
        assert w.wait_persisted(timeout_s=180) == 2
        dist.barrier()
        if rank == 1:  # a replaced machine: its memory tier comes back empty
            _wipe(roots[1])
        dist.barrier()
        out = {f"w{rank}": torch.zeros(1 << 16)}
        reader = GeminiStorageReader(root=roots[rank], job_id="smoke")
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out[f"w{rank}"], state[f"w{rank}"]), "restored bytes differ"
        assert reader.restored_step == 2
    finally:
        dist.destroy_process_group()


def save_and_restore(work: Path) -> None:
    import torch.multiprocessing as mp

    roots = [str(work / f"node{i}") for i in range(2)]
    for r in roots:
        os.mkdir(r, 0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, roots, f"file://{work / 'store'}"), nprocs=2)


def build_extension(work: Path) -> str:
    from gemini_dcp import ext

    csrc = Path(ext.CSRC_DIR)
    assert str(csrc).startswith(sys.prefix), f"the extension's sources {csrc} are not the installed ones"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no compiler: fallback"
    from gemini_dcp.ext import build

    rc = build.main(["--quiet"])
    assert rc == 0, f"the extension did not build from {csrc} (exit {rc})"
    return "built"


def main() -> None:
    work = Path(sys.argv[1])
    import gemini_dcp

    where = Path(gemini_dcp.__file__).resolve()
    assert str(where).startswith(str(Path(sys.prefix).resolve())), f"gemini_dcp imported from {where}, not the venv"
    report = {"modules": import_everything()}
    save_and_restore(work)
    report["save_restore"] = "ok"
    report["extension"] = build_extension(work)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
