"""The extension as a package: ExtOptions (the GEMINI_DCP_EXT* variables), where the loader finds
``csrc/`` (checkout, then installed package data), the ahead-of-time build command, and the
sdist/wheel carrying the sources (built with pip / setuptools in subprocesses: the slow lane).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from gemini_dcp import ext
from gemini_dcp.errors import ConfigError
from gemini_dcp.ext import build as ext_build
from gemini_dcp.ext.loader import Loader, csrc_candidates, find_csrc
from gemini_dcp.options.ext import ExtOptions, default_cache_dir

REPO = Path(__file__).resolve().parents[1]
CSRC_FILES = ("csrc/gemini_ops.cpp", "csrc/cuda/gemini_cuda.cu")


# ------------------------------------------------------------------------------------ options


def test_ext_options_defaults_and_spellings(tmp_path: Path) -> None:
    o = ExtOptions.from_env({})
    assert (o.mode, o.cuda, o.cache_dir, o.verbose, o.required) == ("auto", "auto", default_cache_dir(), False, False)
    env = {"GEMINI_DCP_EXT": " Never ", "GEMINI_DCP_CUDA_EXT": "1", "GEMINI_DCP_EXT_CACHE": str(tmp_path),
           "GEMINI_DCP_EXT_VERBOSE": "yes"}
    o = ExtOptions.from_env(env)
    assert (o.mode, o.cuda, o.cache_dir, o.verbose) == ("never", "required", tmp_path, True)
    assert not o.required  # never wins over a required CUDA build
    for raw, want in (("0", "never"), ("off", "never"), ("false", "never"), ("", "auto"), ("AUTO", "auto"),
                      ("1", "required"), ("force", "required"), ("require", "required"), ("on", "required")):
        assert ExtOptions.from_env({"GEMINI_DCP_EXT": raw}).mode == want, raw
    assert ExtOptions.from_env({"GEMINI_DCP_CUDA_EXT": "1"}).required
    assert ExtOptions.from_env({"GEMINI_DCP_EXT_CACHE": "~/x"}).cache_dir == Path.home() / "x"


@pytest.mark.parametrize("name, value, match", [
    ("GEMINI_DCP_EXT", "maybe", r"GEMINI_DCP_EXT='maybe' is not a valid setting: use auto .* 0 .* 1"),
    ("GEMINI_DCP_CUDA_EXT", "2", r"GEMINI_DCP_CUDA_EXT='2' is not a valid setting"),
    ("GEMINI_DCP_EXT_VERBOSE", "loud", r"GEMINI_DCP_EXT_VERBOSE='loud' is not a flag; set it to 1 or 0"),
])
def test_ext_options_bad_env_names_the_variable_and_the_fix(name: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ExtOptions.from_env({name: value})


def test_ext_options_validates_direct_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mode='1'.*'auto', 'never', 'required'"):
        ExtOptions(mode="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda="):
        ExtOptions(cuda="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected a path"):
        ExtOptions(cache_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="name a folder"):
        ExtOptions(cache_dir="  ")  # type: ignore[arg-type]
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder.*GEMINI_DCP_EXT_CACHE"):
        ExtOptions(cache_dir=a_file)
    with pytest.raises(ConfigError, match="verbose"):
        ExtOptions(verbose="1")  # type: ignore[arg-type]
    assert ExtOptions(cache_dir=str(tmp_path)).cache_dir == tmp_path  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ExtOptions("auto")  # type: ignore[misc]  # keyword-only
    with pytest.raises(AttributeError):
        ExtOptions().mode = "never"  # type: ignore[misc]  # frozen


def test_loader_with_fixed_options_ignores_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_EXT", "1")
    loader = Loader(tmp_path / "no-csrc", ExtOptions(mode="never", cache_dir=tmp_path / "cache"))
    assert loader.load() is False and "GEMINI_DCP_EXT=0" in loader.how
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------- locating csrc


def _fake_install(site: Path, with_sources: bool = True) -> Path:
    """site/gemini_dcp/ext (+ csrc as package data), as a wheel installs it; returns the ext folder."""
    pkg = site / "gemini_dcp" / "ext"
    pkg.mkdir(parents=True)
    if with_sources:
        for name in CSRC_FILES:
            dst = pkg / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, dst)
    return pkg


def test_checkout_sources_are_found_first() -> None:
    assert ext.CSRC_DIR == REPO / "csrc" == find_csrc()
    assert csrc_candidates()[0] == REPO / "csrc"
    assert csrc_candidates()[1] == REPO / "gemini_dcp" / "ext" / "csrc"


def test_installed_layout_uses_the_package_data(tmp_path: Path) -> None:
    pkg = _fake_install(tmp_path / "site-packages")
    # site-packages/csrc of some other distribution is not ours: no pyproject.toml beside it.
    (tmp_path / "site-packages" / "csrc").mkdir()
    (tmp_path / "site-packages" / "csrc" / "gemini_ops.cpp").write_text("// someone else's\n")
    assert csrc_candidates(pkg) == [pkg / "csrc"]
    assert find_csrc(pkg) == pkg / "csrc"
    # The same sources hash to the same cache folder as the checkout's: one build serves both.
    opts = ExtOptions(cache_dir=tmp_path / "cache")
    assert Loader(pkg / "csrc", opts).build_dir(False) == Loader(ext.CSRC_DIR, opts).build_dir(False)


def test_install_without_sources_says_what_to_do(tmp_path: Path) -> None:
    pkg = _fake_install(tmp_path / "site-packages", with_sources=False)
    assert find_csrc(pkg) is None
    loader = Loader(pkg / "csrc", ExtOptions(mode="required", cuda="never", cache_dir=tmp_path / "cache"))
    with pytest.raises(ext.ExtensionBuildError, match="sources not found.*Reinstall gemini-dcp.*GEMINI_DCP_EXT=0"):
        loader.load()


def test_build_command_rejects_a_file_as_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exc:
        ext_build.main(["--cache", str(a_file)])
    assert exc.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_build_command_fails_when_required_cuda_cannot_build(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine may build the CUDA ops")
    cache = tmp_path / "cache"
    assert ext_build.main(["--cuda", "required", "--cache", str(cache), "-q"]) == 1
    assert ext_build.main(["--cuda", "required", "--cache", str(cache), "-q", "--best-effort"]) == 1
    assert not cache.exists()


# ------------------------------------------------------------------------- sdist and wheel (slow)


def _copy_tree(dst: Path) -> Path:
    """What a source distribution is made from, without caches or build leftovers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".mypy_cache", ".ruff_cache")
    dst.mkdir()
    for name in ("pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, dst / name)
    for name in ("gemini_dcp", "cli", "csrc"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    return dst


def _pip_wheel(src: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "--disable-pip-version-check", str(src), "-w", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("gemini_dcp-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return _pip_wheel(_copy_tree(tmp / "src"), tmp / "dist")


def test_wheel_ships_csrc_as_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in CSRC_FILES:
        assert f"gemini_dcp/ext/{f}" in names, sorted(n for n in names if "ext/" in n)
    assert {"gemini_dcp/ext/loader.py", "gemini_dcp/ext/cpu.py", "gemini_dcp/ext/cuda.py",
            "gemini_dcp/ext/build.py", "gemini_dcp/options/ext.py", "gemini_dcp_cli/main.py"} <= names
    assert not any(n.startswith("csrc/") for n in names)  # inside the package, not a top-level folder


def test_sdist_ships_csrc_and_its_wheel_does_too(tmp_path: Path) -> None:
    src = _copy_tree(tmp_path / "src")
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sdist")], cwd=src,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (tmp_path / "sdist").glob("gemini_dcp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        for f in CSRC_FILES + ("MANIFEST.in", "pyproject.toml", "gemini_dcp/ext/loader.py"):
            assert f"{top}/{f}" in names, f
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(tmp_path / "unpacked", filter="data")
        else:
            tar.extractall(tmp_path / "unpacked")  # noqa: S202 - our own freshly built sdist
    wheel = _pip_wheel(tmp_path / "unpacked" / top, tmp_path / "dist")
    names2 = set(zipfile.ZipFile(wheel).namelist())
    assert all(f"gemini_dcp/ext/{f}" in names2 for f in CSRC_FILES)


def test_installed_wheel_finds_its_csrc(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from gemini_dcp import ext\n"
        "print(ext.__file__); print(ext.CSRC_DIR); print(ext._LOADER.build_dir(False).name)\n"
        "assert ext.load() is False and 'GEMINI_DCP_EXT=0' in ext.status()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site), GEMINI_DCP_EXT="0", GEMINI_DCP_EXT_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    mod_file, csrc, build_name = r.stdout.split()[:3]
    assert Path(mod_file) == site / "gemini_dcp" / "ext" / "__init__.py"
    assert Path(csrc) == site / "gemini_dcp" / "ext" / "csrc"
    assert build_name == Loader(ext.CSRC_DIR, ExtOptions(cache_dir=tmp_path)).build_dir(False).name
