#!/usr/bin/env bash
# One setup path for every README command: creates .venv, installs the project with the
# engine build that fits this machine, and removes the torchvision/torchaudio/torchcodec
# wheels that do not match the CPU torch (they break `import vllm`). Idempotent: when
# pyproject.toml has not changed since the last successful run, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ENGINE=gpu
else
    ENGINE=cpu
fi
EXTRAS="server,$ENGINE,bench,ray,openai,docs,dev"
STAMP="$VENV/.justitia-setup"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

echo "setup: creating $VENV with extras [$EXTRAS] (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
if [ "$ENGINE" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec are built against another torch and make
    # `import vllm` die with "operator torchvision::nms does not exist".
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import vllm, fastapi, sklearn, xdist" >/dev/null
echo "$WANT" > "$STAMP"
echo "setup: done" >&2
