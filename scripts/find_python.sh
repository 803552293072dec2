#!/usr/bin/env bash
# Print the path of a Python X.Y interpreter, or say in one line that there is none and fail.
#
#   scripts/find_python.sh 3.12
#
# Tried in order: pythonX.Y on PATH (a pyenv shim counts only if it runs: pyenv keeps shims
# for versions that are installed but not selected), then pyenv's own installs
# ($(pyenv root)/versions/X.Y.*, the newest patch release), then /usr/bin/pythonX.Y.
set -euo pipefail

want=${1:?usage: find_python.sh X.Y}

works() {  # the interpreter runs and is the version asked for
    [ -n "$1" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
        >/dev/null 2>&1
}

candidates=()
if command -v "python$want" >/dev/null 2>&1; then
    candidates+=("$(command -v "python$want")")
fi
root=""
if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root 2>/dev/null || true)
fi
root=${root:-${PYENV_ROOT:-$HOME/.pyenv}}
if [ -d "$root/versions" ]; then
    while IFS= read -r dir; do
        candidates+=("$dir/bin/python$want")
    done < <(ls -d "$root/versions/$want".* 2>/dev/null | sort -rV)
fi
candidates+=("/usr/bin/python$want" "/usr/local/bin/python$want")

for python in "${candidates[@]}"; do
    if works "$python"; then
        # a pyenv shim resolves to the real interpreter, so the venv does not depend on the shim
        "$python" -c "import sys; print(sys.executable)"
        exit 0
    fi
done
echo "find_python.sh: no Python $want here (not on PATH, not in pyenv's $root/versions, not in /usr/bin);" \
     "install it (e.g. \`pyenv install $want\`) or pass its path (make ... BASE_PYTHON${want/./}=/path/to/python$want)" >&2
exit 1
