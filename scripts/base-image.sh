#!/usr/bin/env bash
# Make the images' base, Debian bookworm with its Python 3.11, from Debian's packages alone, for a
# machine that reaches a Debian mirror but no image registry (the Dockerfile's BASE_IMAGE,
# docs/containers.md "Offline and behind a proxy"):
#
#   scripts/base-image.sh [TAG]            # default tag: splitserve-base:bookworm
#   docker build --build-arg BASE_IMAGE=splitserve-base:bookworm ...
#
# A minbase root filesystem from $DEBIAN_MIRROR (default: the first mirror apt uses here, else
# deb.debian.org), with python3, python3-venv and ca-certificates already in (the Dockerfile installs
# them only where missing), then `docker import` of it. Made by mmdebstrap where it is installed (one apt
# run that unpacks every package at once, without dpkg's fsyncs: about 30 s on 2 cores), else by
# debootstrap (a dpkg run per package: about 55 s). The same 118 packages either way: bookworm's
# mmdebstrap merges /usr with its merged-usr hook, as debootstrap does, instead of installing usrmerge
# (and perl with it, 48 MB). Needs root, one of them and a reachable Docker engine. Images it makes
# carry the label splitserve.base=1.
# Environment: DOCKER (the docker CLI; docker), DEBIAN_MIRROR, SUITE (bookworm), BOOTSTRAP (mmdebstrap
# or debootstrap: which one, instead of the first installed).
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

bootstrap=${BOOTSTRAP:-}
if [ -z "$bootstrap" ]; then
    bootstrap=debootstrap
    if command -v mmdebstrap >/dev/null; then bootstrap=mmdebstrap; fi
fi
case "$bootstrap" in
mmdebstrap | debootstrap) ;;
*) echo "base-image: BOOTSTRAP=$bootstrap: mmdebstrap or debootstrap" >&2; exit 2 ;;
esac
for tool in "$bootstrap" "$docker"; do
    command -v "$tool" >/dev/null || { echo "base-image: $tool not found (apt-get install debootstrap docker.io)" >&2; exit 1; }
done

root=$(mktemp -d "${TMPDIR:-/tmp}/splitserve-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
options=(--variant=minbase --include=python3,python3-venv,ca-certificates)
hooks=/usr/share/mmdebstrap/hooks/merged-usr
if [ "$bootstrap" = mmdebstrap ] && [ -d "$hooks" ]; then options+=("--hook-dir=$hooks"); fi
echo "base-image: $bootstrap $suite from $mirror" >&2
"$bootstrap" "${options[@]}" "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# what a container image leaves out: apt's downloaded packages and lists
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'LABEL splitserve.base=1' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag" >/dev/null
echo "base-image: $tag" >&2
