#!/usr/bin/env bash
# The virtual environment with LiteLLM's proxy, for the side-by-side comparison in
# benchmarks/gateway_overhead.py (not a dependency of duetime).
#
#   scripts/litellm_env.sh [VENV_DIR]      (default: <repo>/.venv-litellm)
#
# LiteLLM's proxy pins its own FastAPI/pydantic stack, so it lives apart from the project's
# .venv. Idempotent: a stamp file records the installed version. About 2 minutes and 760 MB.
set -euo pipefail

LITELLM_VERSION="1.108.7"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-litellm}"
python="${PYTHON:-python3}"
stamp="$venv/.duetime-litellm-stamp"
want="litellm[proxy]==$LITELLM_VERSION"

fail() { echo "litellm_env.sh: error: $*" >&2; exit 1; }

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/litellm" ]]; then
    echo "litellm_env.sh: $want already in $venv"
    exit 0
fi
command -v "$python" >/dev/null || fail "no '$python' on PATH (set PYTHON=/path/to/python3)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv" || fail "'$python -m venv $venv' failed"
rm -f "$stamp"
echo "litellm_env.sh: installing $want into $venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$want" 2>&1 \
    | { grep -v "is neither a file nor a directory" || true; }
[[ -x "$venv/bin/litellm" ]] || fail "pip did not install the litellm command in $venv"
echo "$want" > "$stamp"
echo "litellm_env.sh: done; run: python benchmarks/gateway_overhead.py --litellm $venv/bin/litellm"
