"""The exit guard (``gemini_dcp.transport.exit_guard``) — real gloo processes.

A rank that exits without ``destroy_process_group`` could abort (SIGABRT, "terminate called
without an active exception") when one of gloo's worker threads was still releasing a finished
collective's tensors: that needs the GIL, and a thread that takes the GIL once the interpreter is
finalizing is ended inside a ``noexcept`` destructor. The guard waits at exit (bounded) until the
workers are idle. The race is rare on its own, so the second test makes it likely: a small
``LD_PRELOAD`` library holds each GIL acquisition of a gloo worker until the interpreter
finalizes or 100 ms passed, as a worker descheduled on a loaded host would be. With it, plain
``dist.all_gather_object`` + exit (no gemini_dcp) aborted in 7 of 30 pairs of ranks; with the
guard installed, 0 of 30. (This test's ranks also build the package's control group, which
changes the timing: there the amplifier alone aborted less often, so a pass here is a
regression check, not a proof; the proof is the paired count above.)
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mp_utils import free_port

REPO = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
pytestmark = pytest.mark.skipif(not LINUX, reason="the guard reads /proc/self/task (Linux x86_64/aarch64)")

RANK = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from gemini_dcp.transport import comm, exit_guard
    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    comm.get_comm(60.0)  # the package's first distributed use installs the guard
    out = [None, None]
    dist.all_gather_object(out, {"rank": rank, "pad": list(range(1000))})
    assert out[1 - rank]["rank"] == 1 - rank
    if mode == "probe":
        assert exit_guard.wait_gloo_idle(limit_s=60.0), exit_guard.busy_gloo_workers()
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        assert names.count("pt_gloo_runloop") >= 2, names  # the check is not vacuous: it saw the workers
        assert exit_guard.busy_gloo_workers() == []
    # leave without destroy_process_group, as a training script that ends after its last load
""").replace("import os, sys", "import os, sys\nfrom pathlib import Path")

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

static void hold(void) {  /* a gloo worker late for the GIL: until finalizing, at most 100 ms */
    char name[32] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    if (strcmp(name, "pt_gloo_runloop") != 0) return;
    int (*fin)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
    for (int i = 0; i < 100 && !(fin && fin()); i++) usleep(1000);
}
void PyEval_AcquireThread(void* t) { static void (*real)(void*); if (!real) real = dlsym(RTLD_NEXT, "PyEval_AcquireThread"); hold(); real(t); }
void PyEval_RestoreThread(void* t) { static void (*real)(void*); if (!real) real = dlsym(RTLD_NEXT, "PyEval_RestoreThread"); hold(); real(t); }
int PyGILState_Ensure(void) { static int (*real)(void); if (!real) real = dlsym(RTLD_NEXT, "PyGILState_Ensure"); hold(); return real(); }
"""


def _pair(script: Path, mode: str, env: dict[str, str]) -> list[tuple[int, str]]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=180)
        out.append((p.returncode, text[-2000:]))
    return out


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_idle_gloo_workers_are_seen_idle(tmp_path: Path) -> None:
    """After a collective, the guard finds the workers of both groups (default + control) and sees them idle."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    assert _pair(script, "probe", _env()) == [(0, ""), (0, "")]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the LD_PRELOAD amplifier")
def test_exit_without_destroy_survives_a_gloo_worker_late_for_the_gil(tmp_path: Path) -> None:
    src, lib = tmp_path / "late_gil.c", tmp_path / "late_gil.so"
    src.write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl", "-lpthread"], check=True)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # The amplifier holds every GIL acquisition of a worker up to 100 ms: on a loaded host a worker's
    # releases then outlast the default 2 s bound (the guard gave up at 2.04 s with a worker still in the
    # shim's sleep, and that rank aborted). This test checks the mechanism (wait until the workers are
    # idle), so its bound is wide; the default bound stays what a real exit should wait at most.
    env = _env(LD_PRELOAD=str(lib), GEMINI_DCP_EXIT_WAIT_S="60")
    for attempt in range(4):
        out = _pair(script, "exit", env)
        assert [code for code, _ in out] == [0, 0], (attempt, out)  # -6: the abort the guard prevents
