#!/usr/bin/env bash
# Make a Docker engine answer and build the farm's runtime image, offline-capable. Idempotent.
#
# Usage (from the repository root, after the project is installed in the venv):
#   bash .ci/docker-setup.sh [PYTHON]        PYTHON defaults to .venv/bin/python
#
# Steps, each skipped when already done:
#   1. install Debian's docker.io (and debootstrap, iproute2) when dockerd or ip is missing;
#   2. start dockerd in the background when no engine answers;
#   3. make a base image: the official python:3.11-slim when it is present or can be pulled, else a
#      minimal Debian (debootstrap, python3 + venv) imported as envscaler-base:bookworm;
#   4. build the project's wheels on the host into dist/wheels and the runtime image from them
#      (envscaler build --runtime-only; the Dockerfile installs only from those wheels).
# Exit status: 0 when the engine answers and the runtime image exists, non-zero otherwise.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"
OFFICIAL_BASE="python:3.11-slim"
LOCAL_BASE="envscaler-base:bookworm"

say() { echo "docker-setup: $*" >&2; }

engine_answers() { docker info >/dev/null 2>&1; }

# The farm needs iptables (host firewall rule), nsenter and ip (removing the containers' default route).
if ! command -v dockerd >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 || ! command -v nsenter >/dev/null 2>&1; then
    say "installing docker.io, iproute2 and util-linux"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io iproute2 util-linux debootstrap >/dev/null
fi

if ! engine_answers; then
    say "starting dockerd"
    # setsid: the engine must outlive this script and the shell that ran it.
    setsid nohup dockerd >/var/log/envscaler-dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 1 60); do
        engine_answers && break
        sleep 1
    done
    engine_answers || { say "dockerd did not answer within 60 s; see /var/log/envscaler-dockerd.log"; exit 1; }
fi
say "engine answers: $(docker version --format '{{.Server.Version}}')"

if docker image inspect "$OFFICIAL_BASE" >/dev/null 2>&1 || docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    say "base image present"
elif timeout 60 docker pull -q "$OFFICIAL_BASE" >/dev/null 2>&1; then
    say "pulled $OFFICIAL_BASE"
else
    say "no registry reachable: building $LOCAL_BASE with debootstrap"
    command -v debootstrap >/dev/null 2>&1 || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    ROOTFS="$(mktemp -d /var/tmp/envscaler-rootfs.XXXXXX)"
    trap 'rm -rf "$ROOTFS"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$ROOTFS" http://deb.debian.org/debian >/dev/null
    # The image needs no package manager caches or lists; they only make it bigger.
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | docker import -c 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$ROOTFS"
    trap - EXIT
    say "imported $LOCAL_BASE"
fi

# Builds this project's wheel and its dependencies into dist/wheels (offline when they are there), then
# the runtime image from the top-level Dockerfile.
"$PYTHON" -m envscaler.cli build --runtime-only
