#!/usr/bin/env bash
# Install gemini_dcp and its CPU stack (idempotent; quick when already installed).
# torch 2.13.0 CPU + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0 (without its CUDA deps) is a known-good set.
# GEMINI_DCP_TORCH=2.7.1 installs another torch when none is installed (the supported floor is 2.7;
# torchrec has a known-good pairing for 2.7, 2.9-2.14; others skip the torchrec tests).
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
if ! have torch; then pipi "torch==${GEMINI_DCP_TORCH:-2.13.0}"; fi
TORCH_MINOR=$("$PY" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
if [ "${GEMINI_DCP_SKIP_TORCHREC:-0}" != "1" ] && ! have torchrec; then
  case "$TORCH_MINOR" in
    2.7) FBGEMM=1.2.0; TREC=1.2.0; TDICT="tensordict==0.8.3" ;;
    2.9) FBGEMM=1.4.2; TREC=1.4.0; TDICT="tensordict==0.10.0" ;;
    2.10) FBGEMM=1.5.0; TREC=1.5.1; TDICT="tensordict==0.11.0" ;;
    2.11) FBGEMM=1.6.0; TREC=1.6.1; TDICT=tensordict ;;
    2.12) FBGEMM=1.7.0; TREC=1.7.0; TDICT=tensordict ;;
    2.13) FBGEMM=1.8.0; TREC=1.8.0; TDICT=tensordict ;;
    2.14) FBGEMM=1.9.0; TREC=1.9.0; TDICT=tensordict ;;
    *) FBGEMM=""; TREC="" ;;
  esac
  if [ -n "$FBGEMM" ]; then
    # torch==<installed> keeps pip from "upgrading" torch for a dependency (tensordict>=0.15 wants torch>=2.11).
    TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    pipi "torch==$TORCH_VER" "fbgemm-gpu-cpu==$FBGEMM" "$TDICT" "torchmetrics==1.0.3" tqdm pyre-extensions iopath
    pipi --no-deps "torchrec==$TREC"
  else
    echo "install.sh: no known-good torchrec for torch $TORCH_MINOR; torchrec tests will be skipped" >&2
  fi
fi
# (Re)install editable when missing, or when installed from another checkout than this one.
HERE=$(pwd -P)
FROM=$(cd / && "$PY" -c 'import gemini_dcp, os; print(os.path.dirname(os.path.dirname(os.path.realpath(gemini_dcp.__file__))))' 2>/dev/null || true)
if [ "$FROM" != "$HERE" ] || ! have pytest-timeout || ! have moto; then
  pipi -e ".[test]"
fi
# Build the C++ extension now (cached per machine) rather than in the first save of a job;
# GEMINI_DCP_EXT=0 skips it (pure-torch fallbacks), GEMINI_DCP_CUDA_EXT=0|1 skips/forces the CUDA ops.
if [ "${GEMINI_DCP_EXT:-auto}" != "0" ]; then
  (cd / && "$PY" -c 'from gemini_dcp import ext; ext.load(); print("gemini_dcp.ext:", ext.status())')
fi
"$PY" -c 'import gemini_dcp, torch; print(f"gemini_dcp {gemini_dcp.__version__} on torch {torch.__version__}")'
