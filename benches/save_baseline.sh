#!/usr/bin/env bash
# Save a pytest-benchmark baseline of benches/ into benches/baselines/ (committed), e.g.
#   benches/save_baseline.sh                      # all benches
#   benches/save_baseline.sh -k "replay or core"  # a subset (extra args go to pytest)
# Compare a change against the latest saved baseline:
#   .venv/bin/pytest benches --benchmark-only --benchmark-storage=file://benches/baselines --benchmark-compare
# or against one run by its number (0001, ...), failing on a regression of the median above 10%:
#   ... --benchmark-compare=0001 --benchmark-compare-fail=median:10%
# Baselines live in benches/baselines/<machine-id>/NNNN_<commit>_<date>.json: compare on the same machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST="${PYTEST:-.venv/bin/pytest}"
exec "$PYTEST" benches --benchmark-only --benchmark-storage=file://benches/baselines --benchmark-autosave \
    --benchmark-columns=min,median,mean,rounds "$@"
