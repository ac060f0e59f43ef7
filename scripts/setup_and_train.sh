#!/usr/bin/env bash
# Installs what is missing (Debian packages, the Fashion-MNIST data), builds tandem and
# trains LeNet on Fashion-MNIST: on a GPU if there is one, else on the CPU.
# Extra arguments go to the training program (see build/examples/lenet --help).
#
# It prints one line per step (the packages it installs, the build, the training); what
# apt-get, dpkg and the build print goes to build/setup.log (LOG=<file> puts it elsewhere,
# BUILD=<dir> builds elsewhere), whose last lines it shows when a step fails, exiting non-zero.
# The training program's output is shown as it is. Runs as root without a terminal (a fresh
# Debian machine, CI) or as a user with sudo, which asks for a password once, before the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
mkdir -p "$BUILD"
LOG=${LOG:-$BUILD/setup.log}
mkdir -p "$(dirname "$LOG")"
LOG="$(cd "$(dirname "$LOG")" && pwd)/$(basename "$LOG")"
: > "$LOG"

fail() {
  echo "setup: $*" >&2
  exit 1
}

# step "what it does" command...: one line on the terminal, the command's output in the log; on
# a failure the log's tail and the command's exit status.
step() {
  local what=$1 t0=$SECONDS rc
  shift
  printf 'setup: %s ... ' "$what"
  printf '\n==== %s\n$ %s\n' "$what" "$*" >> "$LOG"
  if "$@" >> "$LOG" 2>&1 < /dev/null; then
    echo "done ($((SECONDS - t0)) s)"
  else
    rc=$?
    echo "FAILED (exit $rc)"
    echo "setup: the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit "$rc"
  fi
}

echo "setup: the output of the installs and of the build goes to $LOG"

pkgs="cmake g++ make libopenblas-dev zlib1g-dev catch2 libgloo-dev nlohmann-json3-dev dataset-fashion-mnist"
if ! command -v dpkg-query > /dev/null; then
  echo "setup: not a Debian system (no dpkg-query): install these or their equivalents yourself: $pkgs"
else
  missing=""
  for p in $pkgs; do
    # No pipe into grep -q: under pipefail, dpkg-query killed by SIGPIPE would count as missing.
    [ "$(dpkg-query -W -f='${Status}' "$p" 2> /dev/null)" = "install ok installed" ] || missing="$missing $p"
  done
  missing=${missing# }
  if [ -z "$missing" ]; then
    echo "setup: Debian packages: all installed ($pkgs)"
  elif ! command -v apt-get > /dev/null; then
    fail "no apt-get to install the missing packages: $missing"
  else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo > /dev/null || fail "not root and no sudo: run this as root, or install as root: $missing"
      # The password prompt (if any) now, on the terminal, not inside a step whose output is logged.
      sudo -v || fail "sudo did not allow the installs: run this as root, or install as root: $missing"
      SUDO="sudo"
    fi
    # sudo resets the environment: DEBIAN_FRONTEND goes through env, after sudo. Without a
    # terminal debconf must not ask anything; Use-Pty=0 keeps dpkg's progress bar out of the log.
    step "updating the package lists (apt-get update)" $SUDO apt-get update
    step "installing the missing Debian packages: $missing" $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends -o Dpkg::Use-Pty=0 $missing
  fi
fi

jobs=$(nproc 2> /dev/null || echo 2)
step "configuring the build in $BUILD/ (cmake)" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
step "building tandem and the LeNet program ($jobs jobs)" cmake --build "$BUILD" -j"$jobs" --target lenet

echo "setup: training LeNet on Fashion-MNIST: $BUILD/examples/lenet $*"
rc=0
"$BUILD/examples/lenet" "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "setup: training failed (exit $rc); its output is above" >&2
  exit "$rc"
fi
