#!/usr/bin/env bash
# Docker for the sandbox tests on a fresh Debian machine: install the engine and debootstrap, start
# dockerd in the background, wait until it answers, then build the sandbox image (skipped if present).
# Needs root. The image is built offline from the Debian mirror: no container registry is used.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    nohup dockerd >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /tmp/dockerd.log" >&2; tail -20 /tmp/dockerd.log >&2; exit 1; }
fi
echo "docker engine $(docker version --format '{{.Server.Version}}') is up"

python -m toolgym.tools.sandbox.image
echo "docker + sandbox image ready in $(( $(date +%s) - start ))s"
