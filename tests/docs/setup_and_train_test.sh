#!/usr/bin/env bash
# The README's first command, scripts/setup_and_train.sh, on a fake machine: apt-get, dpkg-query,
# sudo, id and cmake are stubs on PATH that print what the real ones print (pages of it) and
# record how they were called; the "build" makes a lenet that prints an epoch line. Checks that
# the terminal gets one line per step and the training output, the log gets the rest, sudo's
# environment reset does not lose DEBIAN_FRONTEND, and a failing step exits non-zero with the
# log's tail. A few seconds; nothing is installed or built.
#   setup_and_train_test.sh <path of scripts/setup_and_train.sh>
set -uo pipefail
SCRIPT=$1
T=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
failures=0
check() {  # check "what" command...: the command must succeed
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; failures=$((failures + 1)); fi
}

mkdir -p "$T/bin"
# dpkg-query: every package installed except those in $STUB_MISSING.
cat > "$T/bin/dpkg-query" << 'EOF'
#!/usr/bin/env bash
p=${!#}
case " $STUB_MISSING " in *" $p "*) exit 1 ;; esac
printf 'install ok installed'
EOF
# apt-get: a page of dpkg's chatter; records its arguments and DEBIAN_FRONTEND.
cat > "$T/bin/apt-get" << 'EOF'
#!/usr/bin/env bash
echo "apt-get $* DEBIAN_FRONTEND=${DEBIAN_FRONTEND:-unset}" >> "$STUB_CALLS"
for i in $(seq 1 50); do echo "Selecting previously unselected package stub-$i."; done
echo "debconf: unable to initialize frontend: Dialog" >&2
exit "${STUB_APT_RC:-0}"
EOF
# sudo: like the real one's env_reset, the command gets a clean environment.
cat > "$T/bin/sudo" << 'EOF'
#!/usr/bin/env bash
echo "sudo $*" >> "$STUB_CALLS"
[ "$1" = "-v" ] && exit 0
exec env -i PATH="$PATH" STUB_CALLS="$STUB_CALLS" STUB_APT_RC="${STUB_APT_RC:-0}" "$@"
EOF
cat > "$T/bin/id" << 'EOF'
#!/usr/bin/env bash
echo "${STUB_UID:-0}"
EOF
# cmake: configure and build chatter; the build writes <build>/examples/lenet.
cat > "$T/bin/cmake" << 'EOF'
#!/usr/bin/env bash
echo "cmake $*" >> "$STUB_CALLS"
if [ "$1" = "--build" ]; then
  for i in $(seq 1 50); do echo "[ $((i * 2))%] Building CXX object kernels/stub_$i.cpp.o"; done
  if [ -n "${STUB_BUILD_FAIL:-}" ]; then echo "kernels/stub.cpp:1:1: error: stub build error"; exit 2; fi
  mkdir -p "$2/examples"
  printf '#!/bin/sh\necho "epoch   1  loss 0.5000 args: $*"\nexit ${STUB_TRAIN_RC:-0}\n' > "$2/examples/lenet"
  chmod +x "$2/examples/lenet"
else
  for i in $(seq 1 20); do echo "-- Looking for stub_$i - found"; done
fi
EOF
chmod +x "$T/bin/"*

# run <name> [VAR=value...]: the script in a fresh copy of scripts/ under $T/<name>, with the stubs.
run() {
  local name=$1
  shift
  mkdir -p "$T/$name/scripts"
  cp "$SCRIPT" "$T/$name/scripts/setup_and_train.sh"
  : > "$T/$name.calls"
  env PATH="$T/bin:$PATH" STUB_CALLS="$T/$name.calls" "$@" \
    bash "$T/$name/scripts/setup_and_train.sh" --epochs 1 < /dev/null > "$T/$name.out" 2> "$T/$name.err"
  echo $? > "$T/$name.rc"
}
quiet() {  # no chatter of apt-get, dpkg, debconf or the build on the terminal
  ! grep -qE 'Selecting previously|debconf|Building CXX|Looking for' "$T/$1.out" "$T/$1.err"
}

# Root, two packages missing, no terminal (CI).
run root STUB_MISSING="catch2 libgloo-dev"
check "root: exits 0" grep -qx 0 "$T/root.rc"
check "root: nothing but the steps and the training on the terminal" quiet root
check "root: installs the missing packages, naming them" grep -q '^setup: installing the missing Debian packages: catch2 libgloo-dev ... done' "$T/root.out"
check "root: apt-get runs without debconf questions" grep -q 'install .*catch2 libgloo-dev DEBIAN_FRONTEND=noninteractive' "$T/root.calls"
check "root: no sudo" bash -c "! grep -q '^sudo' '$T/root.calls'"
check "root: the training output as it is, with the arguments" grep -qx 'epoch   1  loss 0.5000 args: --epochs 1' "$T/root.out"
check "root: the log has what apt-get and the build printed" grep -q 'Selecting previously unselected package stub-50' "$T/root/build/setup.log"
check "root: at most a line per step" test "$(grep -c '^setup:' "$T/root.out")" -le 6

# A user with sudo: the installs go through sudo, and its environment reset keeps DEBIAN_FRONTEND.
run user STUB_MISSING="cmake" STUB_UID=1000
check "user: exits 0" grep -qx 0 "$T/user.rc"
check "user: sudo asked once up front" grep -qx 'sudo -v' "$T/user.calls"
check "user: apt-get through sudo, DEBIAN_FRONTEND kept" grep -q '^apt-get install .*cmake DEBIAN_FRONTEND=noninteractive' "$T/user.calls"
check "user: quiet" quiet user

# A user without sudo: a clear error, nothing attempted.
mkdir -p "$T/nosudo-bin"
for f in "$T/bin/"*; do [ "$(basename "$f")" = sudo ] || ln -s "$f" "$T/nosudo-bin/"; done
mkdir -p "$T/nosudo/scripts" && cp "$SCRIPT" "$T/nosudo/scripts/setup_and_train.sh"
: > "$T/nosudo.calls"
sudo_path=$(command -v sudo || true)
if [ -z "$sudo_path" ]; then
  env PATH="$T/nosudo-bin:$PATH" STUB_CALLS="$T/nosudo.calls" STUB_MISSING="cmake" STUB_UID=1000 \
    bash "$T/nosudo/scripts/setup_and_train.sh" < /dev/null > "$T/nosudo.out" 2> "$T/nosudo.err"
  echo $? > "$T/nosudo.rc"
  check "no sudo: exits non-zero" bash -c "! grep -qx 0 '$T/nosudo.rc'"
  check "no sudo: says so" grep -q 'not root and no sudo' "$T/nosudo.err"
else
  echo "skipped: no sudo (this machine has $sudo_path on PATH)"
fi

# A failing install: non-zero, the log's tail on the terminal.
run badapt STUB_MISSING="catch2" STUB_APT_RC=100
check "failed install: exits 100" grep -qx 100 "$T/badapt.rc"
check "failed install: the step marked FAILED" grep -q 'apt-get update) ... FAILED (exit 100)' "$T/badapt.out"
check "failed install: the log's tail shown" grep -q 'Selecting previously unselected package stub-50' "$T/badapt.err"
check "failed install: no build" bash -c "! grep -q '^cmake' '$T/badapt.calls'"

# A failing build: non-zero, the compiler's error from the log, no training.
run badbuild STUB_BUILD_FAIL=1
check "failed build: exits 2" grep -qx 2 "$T/badbuild.rc"
check "failed build: the error shown" grep -q 'error: stub build error' "$T/badbuild.err"
check "failed build: no training" bash -c "! grep -q '^epoch' '$T/badbuild.out'"

# A failing training run: its exit status.
run badtrain STUB_TRAIN_RC=3
check "failed training: exits 3" grep -qx 3 "$T/badtrain.rc"
check "failed training: says so" grep -q 'training failed (exit 3)' "$T/badtrain.err"

if [ "$failures" -ne 0 ]; then
  for f in "$T"/*.out "$T"/*.err; do echo "---- $(basename "$f")"; cat "$f"; done
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
