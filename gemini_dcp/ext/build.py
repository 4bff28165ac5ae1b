"""Build the C++/CUDA extension ahead of time: ``python -m gemini_dcp.ext.build``.

Compiles the sources :func:`~gemini_dcp.ext.loader.find_csrc` finds (the checkout's
``csrc/`` or an installed wheel's ``gemini_dcp/ext/csrc``) into the cache the runtime loader
uses (``GEMINI_DCP_EXT_CACHE``, default ``~/.cache/gemini_dcp/ext``), so the first
checkpoint of a job loads a cached library instead of compiling. The cache key covers the
sources, flags and torch/Python versions: rerun it after upgrading torch.

    python -m gemini_dcp.ext.build                  # CPU ops, + CUDA ops when CUDA and nvcc are there
    python -m gemini_dcp.ext.build --cuda never     # CPU ops only
    python -m gemini_dcp.ext.build --cuda required  # fail unless the CUDA ops build too
    python -m gemini_dcp.ext.build --best-effort    # as a job would (scripts/install.sh): a failure is reported

Exit status: 0 built or loaded (or ``--best-effort`` and the fallbacks will be used), 1 the build
failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from ..options.ext import MODES, BuildMode, ExtOptions
from .loader import CSRC_DIR, ExtensionBuildError, Loader

__all__ = ["build", "main"]


def build(options: ExtOptions, csrc: Path = CSRC_DIR) -> Loader:
    """Build (or load from the cache) the extension from ``csrc`` with ``options``; the finished loader.

    Raises :class:`~gemini_dcp.ext.loader.ExtensionBuildError` when ``options.required``
    and the build fails.
    """
    loader = Loader(csrc, options)
    loader.load(verbose=options.verbose)
    return loader


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    env = ExtOptions.from_env()
    p = argparse.ArgumentParser(prog="python -m gemini_dcp.ext.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", choices=MODES, default=env.cuda,
                   help="the CUDA ops: auto (when CUDA and nvcc are there), never, required "
                        "(default: GEMINI_DCP_CUDA_EXT, else auto)")
    p.add_argument("--cache", type=Path, default=env.cache_dir,
                   help=f"root of the build cache (default: GEMINI_DCP_EXT_CACHE, else {env.cache_dir})")
    p.add_argument("--best-effort", action="store_true",
                   help="report a failed build and exit 0 (the pure-torch fallbacks will be used), unless "
                        "GEMINI_DCP_EXT=1 or the CUDA ops are required")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the final status line")
    args = p.parse_args(argv)
    try:
        # --best-effort builds as a job would (GEMINI_DCP_EXT=1 or required CUDA ops still fail).
        mode: BuildMode = "required" if not args.best_effort or env.mode == "required" else "auto"
        options = ExtOptions(mode=mode, cuda=args.cuda,
                             cache_dir=args.cache, verbose=not args.quiet)
    except ConfigError as exc:
        p.error(str(exc))
    try:
        loader = build(options)
    except ExtensionBuildError as exc:
        print(f"gemini_dcp.ext: build failed: {exc}", file=sys.stderr)
        return 1
    print(f"gemini_dcp.ext: {loader.how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
