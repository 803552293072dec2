#!/usr/bin/env bash
# Check npuspeed against every megatron-core release it claims to support (0.12 - 0.16).
#
#   scripts/megatron_versions.sh                  # 0.12.0 0.13.0 0.14.0 0.15.0 0.16.1
#   scripts/megatron_versions.sh 0.12.0 0.14.0    # just these
#
# For each release: `pip download --no-deps` its wheel into $NPUSPEED_MC_CACHE/<version>/,
# unpack it with `pip install --no-deps --target $NPUSPEED_MC_CACHE/site-<version>` (nothing
# is installed into the environment: the directory shadows the installed megatron-core when
# put first on PYTHONPATH), then run tests/distributed/test_megatron_versions.py with
# NPUSPEED_MEGATRON_SITES listing those directories: per release, `npuspeed report --json`
# applies or cleanly skips every patch and a 4-iteration TP2+SP example run trains.
# Unpacked releases are reused on later runs. Dependencies are not downloaded (--no-deps):
# the environment's torch and numpy are used, never another torch.
#
# Environment: PYTHON (default: python3), NPUSPEED_MC_CACHE (default:
# ${XDG_CACHE_HOME:-~/.cache}/npuspeed/megatron-core), PYTEST_ARGS (extra pytest arguments).
set -euo pipefail

PYTHON=${PYTHON:-python3}
CACHE=${NPUSPEED_MC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npuspeed/megatron-core}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.12.0 0.13.0 0.14.0 0.15.0 0.16.1)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

sites=()
for version in "${VERSIONS[@]}"; do
    site="$CACHE/site-$version"
    if [ ! -d "$site/megatron/core" ]; then
        echo "== megatron-core $version: download and unpack into $site"
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
            --dest "$CACHE/$version" "megatron-core==$version"
        wheel=$(ls "$CACHE/$version"/megatron_core-"$version"-*.whl | head -n 1)
        "$PYTHON" -m pip install --quiet --no-deps --target "$site" "$wheel"
    fi
    sites+=("$site")
done

cd "$ROOT"
NPUSPEED_MEGATRON_SITES=$(IFS=:; echo "${sites[*]}") \
    exec "$PYTHON" -m pytest -q tests/distributed/test_megatron_versions.py ${PYTEST_ARGS:-}
