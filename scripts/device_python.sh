#!/bin/sh
# The Python that runs the device tier (`make test-device`): one whose torch sees this host's
# accelerator. Prints its path. The host has one when NPUSPEED_DEVICE names cuda/npu, nvidia-smi
# lists a GPU or npu-smi an NPU; then the candidates are DEVICE_PY, the project's venv ($1), and
# python3/python on PATH (a system torch: the venv's is a CPU build where pip chose it), and none
# seeing it is a one-line error (exit 2), not a green run of skips. With no accelerator at all it
# prints the venv's Python: the tier then skips with one reason and exits 0.
venv_py="$1"
accel=""
case "${NPUSPEED_DEVICE:-}" in
  cuda|npu) accel="$NPUSPEED_DEVICE (NPUSPEED_DEVICE=$NPUSPEED_DEVICE)" ;;
esac
if [ -z "$accel" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "GPU"; then
  accel="cuda (nvidia-smi lists a GPU)"
fi
if [ -z "$accel" ] && command -v npu-smi >/dev/null 2>&1 && npu-smi info >/dev/null 2>&1; then
  accel="npu (npu-smi lists an NPU)"
fi
if [ -z "$accel" ]; then
  echo "$venv_py"
  exit 0
fi
kind=${accel%% *}
tried=""
for py in ${DEVICE_PY:-} "$venv_py" python3 python; do
  path=$(command -v "$py" 2>/dev/null) || continue
  tried="$tried $path"
  if "$path" -c "
import sys, torch
if sys.argv[1] == 'npu':
    import torch_npu  # noqa: F401
    sys.exit(0 if torch.npu.is_available() else 1)
sys.exit(0 if torch.cuda.is_available() else 1)
" "$kind" >/dev/null 2>&1; then
    echo "$path"
    exit 0
  fi
done
echo "make test-device: this host has $accel, but no Python here has a torch that sees it (tried:${tried:- none}); install a $kind build of torch$( [ "$kind" = npu ] && echo ' with torch_npu') or name its Python with DEVICE_PY=/path/to/python" >&2
exit 2
