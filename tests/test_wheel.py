"""The package as a user installs it: a wheel built from a clean export, installed non-editable into
a fresh virtual environment, run from a folder outside the checkout.

The venv sees the machine's torch (``--system-site-packages``: the wheel is installed with
``--no-deps``, nothing is downloaded), and the checks run with the checkout nowhere on the path:
:mod:`wheel_smoke` (every module imports, two ranks save with ``replicas=2`` and a ``file://``
persistent tier drained by the installed drain server, a wiped node restores from its peer, the
extension builds from the installed sources), then the installed ``gemini-dcp`` command's
``doctor`` and ``inspect``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("gemini_dcp", "cli", "csrc", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def _export(dst: Path) -> Path:
    """The files of the checkout a clean clone would have (tracked, plus new files git does not ignore)."""
    dst.mkdir()
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *SHIPPED], cwd=REPO,
                               capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        names = [str(p.relative_to(REPO)) for s in SHIPPED for p in ([REPO / s] if (REPO / s).is_file()
                 else (REPO / s).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _export(tmp / "src")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "--disable-pip-version-check", str(src), "-w", str(tmp / "dist")],
                       capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp / "dist").glob("gemini_dcp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(REPO)).replace("cli/", "gemini_dcp_cli/", 1) for p in REPO.glob("gemini_dcp/**/*.py")}
    shipped |= {f"gemini_dcp_cli/{p.name}" for p in (REPO / "cli").glob("*.py")}
    assert shipped <= names, sorted(shipped - names)  # every module, none listed by hand
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--disable-pip-version-check",
                        str(wheel)], capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return env_dir


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GEMINI_DCP_ROOT")}
    env.update(GEMINI_DCP_EXT_CACHE=str(tmp / "ext-cache"), OMP_NUM_THREADS="1")
    return env


def test_the_installed_wheel_saves_restores_drains_and_builds(venv: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    script = shutil.copy(Path(__file__).with_name("wheel_smoke.py"), tmp_path / "wheel_smoke.py")
    r = subprocess.run([str(venv / "bin" / "python"), script, str(work)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100 and report["save_restore"] == "ok", report
    assert report["extension"] in ("built", "no compiler: fallback"), report
    # the installed command, from outside the checkout
    cli = str(venv / "bin" / "gemini-dcp")
    r = subprocess.run([cli, "inspect", "--root", str(work / "node0"), "--job", "smoke", "--json"], cwd=tmp_path,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smoke" in r.stdout
    r = subprocess.run([cli, "doctor", "--root", str(work / "node0"), "--json"], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1: a check of this machine failed (reported, not a crash)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    ext = next(c for name, c in checks.items() if "extension" in name.lower())
    if report["extension"] == "built":
        assert ext["status"] == "pass" and "loaded" in ext["detail"], ext
    else:
        assert "fallback" in ext["detail"].lower() or ext["status"] != "pass", ext
