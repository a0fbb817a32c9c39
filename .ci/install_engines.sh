#!/usr/bin/env bash
# Build the engine venvs the `sglang` / `vllm` tests run under (tests/engines): SGLang 0.5.23 and
# vLLM 0.33.0, each in its own python3.11 venv, from the pinned lists beside this script, with
# --no-deps (the engines pin CUDA torch builds; both run on the local CPU torch 2.13.0 wheel),
# plus this checkout (editable, --no-deps: its deps are in the lists).
# Usage: bash .ci/install_engines.sh [sglang|vllm|both]   (env PREFIXKV_ENGINES, default /tmp/prefixkv-engines)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ROOT=${PREFIXKV_ENGINES:-/tmp/prefixkv-engines}
WHAT=${1:-both}
PY=${PYTHON311:-python3.11}
mkdir -p "$ROOT"
build() {  # name
  local v="$ROOT/$1" t0; t0=$(date +%s)
  rm -rf "$v"
  "$PY" -m venv "$v"
  grep -v '^#' "$HERE/$1-requirements.txt" > "$v/requirements.txt"
  "$v/bin/pip" install -q --no-deps -r "$v/requirements.txt" 2>&1 | grep -v "WARNING: Location 'file:///opt" || true
  "$v/bin/pip" install -q --no-deps -e "$REPO" 2>&1 | grep -v "WARNING: Location 'file:///opt" || true
  "$v/bin/python" -c "import $1, prefixkv.tiers.disk_store, prefixkv.tiers.redis_store" >/dev/null
  echo "engines: $1 venv at $v in $(( $(date +%s) - t0 )) s ($(du -sh "$v" | cut -f1))"
}
case "$WHAT" in
  sglang|vllm) build "$WHAT" ;;
  both) build sglang; build vllm ;;
  *) echo "usage: $0 [sglang|vllm|both]" >&2; exit 2 ;;
esac
