#!/usr/bin/env bash
# Set up what the docker runtime needs, idempotently (CI, or a developer machine as root):
#   1. packages   docker.io + debootstrap, only when dockerd or debootstrap is missing
#   2. engine     start dockerd, only when `docker info` fails
#   3. sdk        the docker SDK for Python, only when it is missing
#   4. base       the local stand-in for python:3.11-slim (docker/make-base-image.sh)
#   5. wheels     the wheelhouse in docker/wheels (the torch 2.13.0 CPU build + runtime deps)
#   6. image      the engine image, through the same code as DockerRuntime.ensure_image
# and print how long each step took (on stderr).
#
# When this run starts dockerd it writes the PID to $CANARY_DOCKERD_PIDFILE
# (default /tmp/serving-canary-dockerd.pid) and prints `export CANARY_DOCKERD_PID=<pid>` on
# stdout, so a caller can do:
#     eval "$(scripts/ci-docker.sh)"
#     trap 'scripts/ci-docker.sh --stop' EXIT     # stops only a dockerd this script started
# `scripts/ci-docker.sh --stop` stops the dockerd named in the PID file (and nothing else).
set -euo pipefail
cd "$(dirname "$0")/.."

PIDFILE="${CANARY_DOCKERD_PIDFILE:-/tmp/serving-canary-dockerd.pid}"
DOCKERD_LOG="${CANARY_DOCKERD_LOG:-/tmp/serving-canary-dockerd.log}"
DATA_ROOT="${CANARY_DOCKERD_DATA_ROOT:-/var/lib/docker}"
PYTHON="${PYTHON:-python}"
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf 'ci-docker: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
TIMES=()
timed() {  # timed NAME CMD...: run CMD, record its wall time
    local name=$1 t0 t1
    shift
    t0=$(now)
    "$@"
    t1=$(now)
    TIMES+=("$(printf '%-9s %6ss' "$name" "$(elapsed "$t0" "$t1")")")
    say "step $name took $(elapsed "$t0" "$t1")s"
}

is_our_dockerd() {  # the PID file names a live dockerd
    local pid
    [ -s "$PIDFILE" ] || return 1
    pid=$(cat "$PIDFILE")
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = dockerd ]
}

if [ "${1:-}" = "--stop" ]; then
    if is_our_dockerd; then
        pid=$(cat "$PIDFILE")
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 60); do [ -d "/proc/$pid" ] || break; sleep 0.5; done
        [ -d "/proc/$pid" ] && say "warning: dockerd $pid is still running after 30s"
    else
        say "no dockerd started by this script is running"
    fi
    rm -f "$PIDFILE"
    exit 0
fi

step_packages() {
    if command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
        say "dockerd and debootstrap are installed"
        return
    fi
    [ "$(id -u)" -eq 0 ] || die "docker.io and debootstrap are missing and this is not root: " \
        "apt-get install docker.io debootstrap as root"
    say "installing docker.io and debootstrap"
    apt-get update -qq
    apt-get install -y -qq docker.io debootstrap >/dev/null
}

step_engine() {
    if docker info >/dev/null 2>&1; then
        say "a Docker engine already answers; not starting one"
        return
    fi
    [ "$(id -u)" -eq 0 ] || die "no Docker engine answers and only root can start dockerd here"
    say "starting dockerd (data root $DATA_ROOT, log $DOCKERD_LOG)"
    mkdir -p "$DATA_ROOT"
    setsid dockerd --data-root "$DATA_ROOT" >"$DOCKERD_LOG" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$PIDFILE"
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && break
        [ -d "/proc/$pid" ] || break
        sleep 0.5
    done
    if ! docker info >/dev/null 2>&1; then
        tail -n 40 "$DOCKERD_LOG" >&2 || true
        kill -TERM "$pid" 2>/dev/null || true
        rm -f "$PIDFILE"
        die "dockerd did not come up (its log is above)"
    fi
    say "dockerd is up (pid $pid)"
    echo "export CANARY_DOCKERD_PID=$pid"  # right away, so that a caller gets it even on failure
}

step_sdk() {
    "$PYTHON" -c 'import docker' 2>/dev/null && return
    say "installing the docker SDK"
    "$PYTHON" -m pip install -q 'docker>=7.0'
}

T0=$(now)
timed packages step_packages
timed engine step_engine
timed sdk step_sdk
timed base docker/make-base-image.sh
timed wheels "$PYTHON" -m canaries.runtime.docker wheelhouse
timed image "$PYTHON" -m canaries.runtime.docker build >&2
say "done in $(elapsed "$T0" "$(now)")s:"
for line in "${TIMES[@]}"; do say "  $line"; done
