#!/bin/sh
# Runs lenet_interop.py with the first python3 that imports torch and safetensors: the one on
# PATH, else Debian's /usr/bin/python3 (where python3-torch installs, and which a pyenv or venv
# python3 on PATH may hide). Exits 77, which ctest counts as a skip, when there is none.
here=$(dirname "$0")
for py in python3 /usr/bin/python3; do
  if command -v "$py" > /dev/null 2>&1 && "$py" -c "import torch, numpy, safetensors.torch" > /dev/null 2>&1; then
    exec "$py" "$here/lenet_interop.py" "$@"
  fi
done
echo "skipped: no python3 here imports torch, numpy and safetensors" \
  "(Debian: apt-get install python3-torch python3-numpy; python3 -m pip install safetensors)"
exit 77
