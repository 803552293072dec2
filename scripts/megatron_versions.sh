#!/usr/bin/env bash
# Check npuspeed against every megatron-core release it supports (0.12 - 0.19), two interpreters.
#
#   scripts/megatron_versions.sh                 # 0.12.0 0.13.0 0.14.0 0.15.0 0.16.1 0.17.0 0.17.1 0.18.2 0.19.2
#   scripts/megatron_versions.sh 0.12.0 0.19.2   # just these
#
# 0.12-0.16 run under PYTHON311 (cp311 wheels), 0.17 and later under PYTHON312 (their wheels
# are cp312 only); a release whose interpreter is not given is skipped with a line saying so
# (and marked so in the table). Each interpreter needs torch, numpy, packaging and pytest.
#
# For each release: `pip download --no-deps` its wheel into $NPUSPEED_MC_CACHE/<version>/,
# unpack it with `pip install --no-deps --target $NPUSPEED_MC_CACHE/site-<version>` (nothing
# is installed into the environment: the directory shadows the installed megatron-core when
# put first on PYTHONPATH), then run tests/distributed/test_megatron_versions.py on it:
# `npuspeed report --json` (patches applied or skipped by range), a 4-iteration TP2+SP run,
# every opt-in feature alone (applied, or refused with its one line), and a 3-iteration parity
# run of each applied flag against the same run without it. Prints the seconds per release and,
# at the end, a Markdown table release x feature (the README carries it).
#
# Environment: PYTHON311 (default: $PYTHON or python3), PYTHON312 (default: none: 0.17+ are
# skipped), NPUSPEED_MC_CACHE (default: ${XDG_CACHE_HOME:-~/.cache}/npuspeed/megatron-core),
# NPUSPEED_VERSIONS_OUT (the JSON results and table.md; default: a temporary directory),
# NPUSPEED_VERSIONS_PARITY_RANKS (1: skip the 2-rank parity runs; default 2), PYTEST_ARGS.
set -uo pipefail

PY311=${PYTHON311:-${PYTHON:-python3}}
PY312=${PYTHON312:-}
CACHE=${NPUSPEED_MC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npuspeed/megatron-core}
OUT=${NPUSPEED_VERSIONS_OUT:-$(mktemp -d -t npuspeed-versions.XXXXXX)}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.12.0 0.13.0 0.14.0 0.15.0 0.16.1 0.17.0 0.17.1 0.18.2 0.19.2)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"

interpreter() {  # the interpreter for a release: 0.17 and later are cp312-only
    local minor=${1#0.}; minor=${minor%%.*}
    if [ "$minor" -ge 17 ]; then echo "$PY312"; else echo "$PY311"; fi
}

failed=() skipped=() times=()
for version in "${VERSIONS[@]}"; do
    py=$(interpreter "$version")
    if [ -z "$py" ]; then
        echo "== megatron-core $version: SKIPPED: its wheels need Python 3.12; set PYTHON312=/path/to/python3.12"
        skipped+=("$version=skipped (no Python 3.12 given)")
        continue
    fi
    site="$CACHE/site-$version"
    if [ ! -d "$site/megatron/core" ]; then
        echo "== megatron-core $version: download and unpack into $site"
        "$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$CACHE/$version" \
            "megatron-core==$version" || { failed+=("$version (download)"); continue; }
        wheel=$(ls "$CACHE/$version"/megatron_core-"$version"-*.whl | head -n 1)
        "$py" -m pip install --quiet --no-deps --target "$site" "$wheel" || { failed+=("$version (unpack)"); continue; }
    fi
    echo "== megatron-core $version with $("$py" -c 'import sys; print(sys.version.split()[0])') ($py)"
    start=$SECONDS
    (cd "$ROOT" && NPUSPEED_MEGATRON_SITES="$site" NPUSPEED_VERSIONS_OUT="$OUT" \
        "$py" -m pytest -q -p no:cacheprovider tests/distributed/test_megatron_versions.py \
        -k "test_release" ${PYTEST_ARGS:-}) || failed+=("$version")
    times+=("$version: $((SECONDS - start)) s")
    echo "== megatron-core $version: $((SECONDS - start)) s"
done

echo
echo "## megatron-core releases (scripts/megatron_versions.sh)"
echo
"$PY311" "$ROOT/tools/megatron_versions_table.py" "$OUT" "${skipped[@]}" | tee "$OUT/table.md"
echo
echo "Seconds per release: ${times[*]:-none}"
echo "Results: $OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
