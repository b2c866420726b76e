#!/usr/bin/env bash
# A Docker engine for the live compose test (tests/deploy/test_compose_live.py) on a CI machine that has
# none running: what .ci/run does before `make test`.
#
#   scripts/docker-engine.sh start DIR   prints the DOCKER_HOST to use (an engine already answering: its
#                                        own; else a dockerd started with everything under DIR)
#   scripts/docker-engine.sh stop DIR    stops the dockerd `start` started (if any) and removes DIR
#
# `start` installs Debian's docker.io and debootstrap first where they are missing (root with apt-get
# only: a user's machine is never changed by `make test`, only CI's), and mmdebstrap where it can: with
# it scripts/base-image.sh makes the images' base in about half debootstrap's time. Exit 1 with one line
# on stderr when no engine can be had; the live test then skips and says why.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    echo "usage: $0 start|stop DIR" >&2
    exit 2
fi

answers() { # answers [DOCKER_HOST]: the engine there replies
    DOCKER_HOST=${1:-${DOCKER_HOST:-}} docker version --format '{{.Server.Version}}' >/dev/null 2>&1
}

case "$cmd" in
start)
    if command -v docker >/dev/null && answers; then
        echo "${DOCKER_HOST:-unix:///var/run/docker.sock}"
        exit 0
    fi
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
            echo "docker-engine: no dockerd/debootstrap, and installing them needs root with apt-get" >&2
            exit 1
        fi
        echo "docker-engine: installing docker.io and debootstrap (apt-get)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io debootstrap \
            >"${TMPDIR:-/tmp}/docker-engine-apt.log" 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                --no-install-recommends docker.io debootstrap >"${TMPDIR:-/tmp}/docker-engine-apt.log" 2>&1; } \
            || { tail -n 5 "${TMPDIR:-/tmp}/docker-engine-apt.log" >&2; exit 1; }
    fi
    if ! command -v mmdebstrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        # optional: without it the base is made with debootstrap
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mmdebstrap \
            >>"${TMPDIR:-/tmp}/docker-engine-apt.log" 2>&1 || true
    fi
    mkdir -p "$dir"
    host="unix://$dir/docker.sock"
    # its state (images, containers, volumes) under DIR; overlay2 as on a normal install
    dockerd --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/docker.pid" -H "$host" \
        --storage-driver overlay2 >"$dir/dockerd.log" 2>&1 &
    for _ in $(seq 1 120); do
        if answers "$host"; then
            echo "$host"
            exit 0
        fi
        sleep 0.5
    done
    echo "docker-engine: dockerd did not answer within 60 s; its log:" >&2
    tail -n 10 "$dir/dockerd.log" >&2
    exit 1
    ;;
stop)
    if [ -s "$dir/docker.pid" ]; then
        pid=$(cat "$dir/docker.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    # what dockerd left mounted (it unmounts on a clean stop)
    grep -o " $dir/[^ ]*" /proc/mounts 2>/dev/null | sort -r | xargs -r -n 1 umount -l 2>/dev/null || true
    rm -rf "$dir"
    ;;
*)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac
