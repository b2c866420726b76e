#!/usr/bin/env bash
# Make the images' base, Debian bookworm with its Python 3.11, from Debian's packages alone, for a
# machine that reaches a Debian mirror but no image registry (the Dockerfile's BASE_IMAGE,
# docs/containers.md "Offline and behind a proxy"):
#
#   scripts/base-image.sh [TAG]            # default tag: splitserve-base:bookworm
#   docker build --build-arg BASE_IMAGE=splitserve-base:bookworm ...
#
# debootstrap --variant=minbase from $DEBIAN_MIRROR (default: the first mirror apt uses here, else
# deb.debian.org), with python3, python3-venv and ca-certificates already in (the Dockerfile installs
# them only where missing), then `docker import` of that root filesystem. Needs root, debootstrap and a
# reachable Docker engine; takes about 40 s. Images it makes carry the label splitserve.base=1.
# Environment: DOCKER (the docker CLI; docker), DEBIAN_MIRROR, SUITE (bookworm).
set -euo pipefail

tag=${1:-splitserve-base:bookworm}
suite=${SUITE:-bookworm}
docker=${DOCKER:-docker}

mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
    # deb822 (/etc/apt/sources.list.d/*.sources) or one-line sources: the first http(s) URI
    mirror=$(grep -h -E '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -o -E 'https?://[^ ]+' | grep -E '/debian/?$' | head -n 1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
fi

for tool in debootstrap "$docker"; do
    command -v "$tool" >/dev/null || { echo "base-image: $tool not found (apt-get install debootstrap docker.io)" >&2; exit 1; }
done

root=$(mktemp -d "${TMPDIR:-/tmp}/splitserve-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap $suite from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# what a container image leaves out: apt's downloaded packages and lists
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'LABEL splitserve.base=1' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag" >/dev/null
echo "base-image: $tag" >&2
