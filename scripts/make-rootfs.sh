#!/usr/bin/env bash
# Make a root filesystem for `xmig run --container ROOTFS`: a minimal Debian with python3 and a
# virtual environment at /opt/xmig/venv holding xmig's dependencies (the CPU build of PyTorch by
# default). xmig itself is not installed: every container mounts the project read-only.
#
#   sudo bash scripts/make-rootfs.sh DIR [PACKAGE ...]
#
# PACKAGEs are more pip requirements for the training script (e.g. "transformers==4.57.1").
# Debian packages come from the machine's own apt mirror, Python packages through the machine's
# own pip configuration (downloaded on this machine, installed inside the rootfs offline).
#
# Environment:
#   TORCH_SPEC           the torch requirement (default torch==2.13.0, as the Makefile's)
#   XMIG_ROOTFS_SUITE    the Debian suite (default: this machine's, else bookworm)
#   XMIG_DEBIAN_MIRROR   Debian mirror base URL (default: the first one in apt's sources)
#   PYTHON               the Python whose pip downloads the wheels (default python3)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT="$(dirname "$HERE")"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV=/opt/xmig/venv

log() { echo "make-rootfs: $*"; }
die() {
    echo "make-rootfs: ERROR: $*" >&2
    exit 1
}

(($# >= 1)) || die "usage: make-rootfs.sh DIR [PACKAGE ...]"
DIR="$(realpath -m "$1")"
shift
EXTRA=("$@")
[[ "$(id -u)" -eq 0 ]] || die "must run as root (debootstrap and chroot)"
command -v debootstrap >/dev/null || die "needs debootstrap (Debian: apt install debootstrap)"
if [[ -e "$DIR/$VENV/bin/python" ]]; then
    die "$DIR already holds a rootfs ($VENV exists): remove it first"
fi
if [[ -d "$DIR" ]] && [[ -n "$(ls -A "$DIR")" ]]; then
    die "$DIR is not empty"
fi

# shellcheck source=scripts/debian-mirror.sh
source "$HERE/debian-mirror.sh"
MIRROR="$(debian_mirror)"
[[ -n "$MIRROR" ]] || die "no Debian mirror found in apt's sources (set XMIG_DEBIAN_MIRROR)"
SUITE="${XMIG_ROOTFS_SUITE:-}"
if [[ -z "$SUITE" ]]; then
    SUITE="$(. /etc/os-release 2>/dev/null && [[ "${ID:-}" == debian ]] &&
        echo "${VERSION_CODENAME:-}" || true)"
    SUITE="${SUITE:-bookworm}"
fi

started=$SECONDS
WORK="$(mktemp -d -t xmig-rootfs.XXXXXX)"
cleanup() {
    rm -rf "$WORK"
    rm -rf "$DIR/tmp/xmig-wheels"
}
trap cleanup EXIT

log "debootstrap $SUITE from $MIRROR into $DIR"
mkdir -p "$DIR"
if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$DIR" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
    tail -n 20 "$WORK/debootstrap.log" >&2
    die "debootstrap failed (the lines above are the end of its log)"
fi
log "base system in $((SECONDS - started)) s"

# the rootfs's Python decides which wheels fit it
CHROOT="$(command -v chroot)"
py_version="$(env -i "$CHROOT" "$DIR" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
mine="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# xmig's own requirements, read from pyproject.toml (xmig itself is mounted at run time)
# shellcheck source=scripts/requirements.sh
source "$HERE/requirements.sh"
mapfile -t REQS < <(xmig_requirements "$PYTHON" "$PROJECT/pyproject.toml")
wanted=("$TORCH_SPEC" "${REQS[@]}" "${EXTRA[@]}")
log "downloading wheels for Python $py_version: ${wanted[*]}"
mkdir -p "$DIR/tmp/xmig-wheels"
download=("$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$DIR/tmp/xmig-wheels")
if [[ "$py_version" != "$mine" ]]; then
    download+=(--only-binary=:all: --python-version "$py_version")
fi
phase=$SECONDS
"${download[@]}" "${wanted[@]}" || die "pip could not download ${wanted[*]}"
log "downloaded in $((SECONDS - phase)) s"

log "installing them into $VENV"
phase=$SECONDS
# inside, nothing of this machine's environment (its pip settings name folders of its own)
inside=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
    LANG=C.UTF-8 "$CHROOT" "$DIR")
"${inside[@]}" python3 -m venv "$VENV"
"${inside[@]}" "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-index --find-links /tmp/xmig-wheels --no-compile "${wanted[@]}" ||
    die "installing into the rootfs failed"
# compiled once here, on every core: the containers' rootfs is read-only
"${inside[@]}" "$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" >/dev/null || true
log "installed and compiled in $((SECONDS - phase)) s"

# what a smaller image can do without: package caches and lists, documentation
rm -rf "$DIR"/var/cache/apt/archives/*.deb "$DIR"/var/lib/apt/lists/* \
    "$DIR"/usr/share/doc/* "$DIR"/usr/share/man/* "$DIR"/root/.cache
torch_version="$("${inside[@]}" "$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
cat >"$DIR/etc/xmig-rootfs" <<EOF
suite=$SUITE
python=$py_version
torch=$torch_version
made=$(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
log "done in $((SECONDS - started)) s: $DIR ($(du -sh "$DIR" | cut -f1), Python $py_version, torch $torch_version)"
log "use it with: xmig run --container $DIR ..."
