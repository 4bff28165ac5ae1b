#!/usr/bin/env bash
# Install gemini_dcp and its CPU stack (idempotent; quick when already installed).
# torch 2.13.0 CPU + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0 (without its CUDA deps) is a known-good set.
# GEMINI_DCP_TORCH=2.7.1 installs another torch when none is installed. The supported range and the
# torchrec pairings are not written here: gemini_dcp/core/torch_support.py reads the range from the installed
# package's metadata (pyproject.toml before the first install) and holds the pairing table
# (`python gemini_dcp/core/torch_support.py torchrec-support`); torch versions without a pairing skip the
# torchrec tests. A torch already installed is never replaced: one outside the range stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
have() { "$PY" - "$1" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
name, _, want = sys.argv[1].partition("==")
v = m.version(name)
sys.exit(0 if (not want or v.split("+")[0] == want) else 1)
PYEOF
}
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
support() { "$PY" gemini_dcp/core/torch_support.py "$@"; }  # run by path: works before torch is installed
if ! have torch; then
  WANT=${GEMINI_DCP_TORCH:-2.13.0}
  support check "$WANT" || { echo "install.sh: GEMINI_DCP_TORCH=$WANT: pick a torch in $(support range)" >&2; exit 1; }
  pipi "torch==$WANT"
fi
# An installed torch outside the range would make pip replace it below; say so and stop instead.
support check-installed || exit 1
TORCH_MINOR=$("$PY" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
if [ "${GEMINI_DCP_SKIP_TORCHREC:-0}" != "1" ] && ! have torchrec; then
  PAIRING=$(support torchrec "$TORCH_MINOR")
  read -r FBGEMM TREC TDICT <<<"${PAIRING:-}" || true
  if [ -n "$FBGEMM" ]; then
    # torch==<installed> keeps pip from "upgrading" torch for a dependency (tensordict>=0.15 wants torch>=2.11).
    TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    pipi "torch==$TORCH_VER" "fbgemm-gpu-cpu==$FBGEMM" "$TDICT" "torchmetrics==1.0.3" tqdm pyre-extensions iopath
    pipi --no-deps "torchrec==$TREC"
  else
    echo "install.sh: no known-good torchrec for torch $TORCH_MINOR (pairings for torch $(support torchrec-support)); torchrec tests will be skipped" >&2
  fi
fi
# (Re)install editable when missing, or when installed from another checkout than this one.
HERE=$(pwd -P)
FROM=$(cd / && "$PY" -c 'import gemini_dcp, os; print(os.path.dirname(os.path.dirname(os.path.realpath(gemini_dcp.__file__))))' 2>/dev/null || true)
# Also when pyproject.toml's torch range changed since the install (the metadata doctor reads would be stale).
# (ruff and mypy, run by scripts/test.sh, and the docs site's mkdocs come with the test extra.)
if [ "$FROM" != "$HERE" ] || ! have pytest-timeout || ! have moto || ! have ruff || ! have mypy || ! have mkdocs-material \
    || ! have mkdocstrings-python || support stale; then
  pipi -e ".[test]"
fi
# Build the C++ extension ahead of time (cached per machine) rather than in the first save of a job;
# GEMINI_DCP_EXT=0 skips it (pure-torch fallbacks), GEMINI_DCP_CUDA_EXT=0|1 skips/forces the CUDA ops.
if [ "${GEMINI_DCP_EXT:-auto}" != "0" ]; then
  (cd / && "$PY" -m gemini_dcp.ext.build --best-effort --quiet)
fi
"$PY" -c 'import gemini_dcp, torch; print(f"gemini_dcp {gemini_dcp.__version__} on torch {torch.__version__}")'
