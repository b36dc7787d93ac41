#!/usr/bin/env bash
# Build xmig's CPU container image with podman, from a base made here, and run its demo in it.
#
#   sudo bash scripts/build-image.sh [--no-demo] [TAG]      (TAG: default localhost/xmig:cpu)
#
# The base is a minimal Debian made by debootstrap from this machine's own apt mirror and
# imported into podman (localhost/xmig-base:SUITE, made once); the wheels (torch's CPU build
# and xmig's requirements) are downloaded through this machine's own pip configuration into the
# build context, so the build itself reaches only the Debian mirror (for CRIU's source and build
# dependencies). Then `xmig run` of the demo GPT with an injected kill runs in the image, and
# its outcome must be bit-identical to the run without the fault.
#
# Environment: TORCH_SPEC (default torch==2.13.0), XMIG_ROOTFS_SUITE, XMIG_DEBIAN_MIRROR,
# PYTHON (whose pip downloads the wheels; default python3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT="$(dirname "$HERE")"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
DEMO=1
if [[ "${1:-}" == "--no-demo" ]]; then
    DEMO=0
    shift
fi
TAG="${1:-localhost/xmig:cpu}"

log() { echo "build-image: $*"; }
die() {
    echo "build-image: ERROR: $*" >&2
    exit 1
}
[[ "$(id -u)" -eq 0 ]] || die "must run as root (debootstrap, podman)"
command -v podman >/dev/null || die "needs podman (Debian: apt install podman)"
command -v debootstrap >/dev/null || die "needs debootstrap (Debian: apt install debootstrap)"

# shellcheck source=scripts/debian-mirror.sh
source "$HERE/debian-mirror.sh"
MIRROR="$(debian_mirror)"
[[ -n "$MIRROR" ]] || die "no Debian mirror found in apt's sources (set XMIG_DEBIAN_MIRROR)"
SUITE="${XMIG_ROOTFS_SUITE:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")}"
SUITE="${SUITE:-bookworm}"
BASE="localhost/xmig-base:$SUITE"

WORK="$(mktemp -d -t xmig-image.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# podman as the measured setup needs it (runc, cgroupfs, no network plugins for the build),
# without touching this machine's own configuration
# (a container may not ask for more open files than this process may have)
cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Sn):$(ulimit -Hn)", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "cni"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"
started=$SECONDS

if ! podman image exists "$BASE"; then
    log "making the base $BASE: debootstrap $SUITE from $MIRROR"
    if ! debootstrap --variant=minbase "$SUITE" "$WORK/base" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
        tail -n 20 "$WORK/debootstrap.log" >&2
        die "debootstrap failed"
    fi
    rm -rf "$WORK"/base/var/cache/apt/archives/*.deb "$WORK"/base/var/lib/apt/lists/*
    tar -C "$WORK/base" -c . | podman import - "$BASE" >/dev/null
    rm -rf "$WORK/base"
    log "base made in $((SECONDS - started)) s"
fi

log "the build context: xmig, and the wheels of torch ($TORCH_SPEC) and xmig's requirements"
context="$WORK/context"
mkdir -p "$context/scripts" "$context/project"
cp "$HERE/install-criu.sh" "$HERE/debian-mirror.sh" "$context/scripts/"
(cd "$PROJECT" && git ls-files -z -- pyproject.toml README.md src examples |
    xargs -0 cp --parents -t "$context/project")
# shellcheck source=scripts/requirements.sh
source "$HERE/requirements.sh"
mapfile -t reqs < <(xmig_requirements "$PYTHON" "$PROJECT/pyproject.toml")
# the image's Python (its suite's python3) decides which wheels fit
case "$SUITE" in
    bookworm) py_version=3.11 ;;
    trixie) py_version=3.13 ;;
    *) py_version="" ;;
esac
mine="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
download=("$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$context/wheels")
if [[ -n "$py_version" && "$py_version" != "$mine" ]]; then
    download+=(--only-binary=:all: --python-version "$py_version")
fi
"${download[@]}" "$TORCH_SPEC" "${reqs[@]}" setuptools wheel || die "pip could not download the wheels"

log "podman build $TAG"
build_started=$SECONDS
podman build --network host --build-arg "BASE=$BASE" -f "$PROJECT/images/Containerfile.cpu" \
    -t "$TAG" "$context"
log "built $TAG in $((SECONDS - build_started)) s ($((SECONDS - started)) s in all); $(podman image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1 / 1e9}')"

if ((DEMO)); then
    log "the demo in the image: the demo GPT on 2 ranks, fault-free and with a rank killed"
    demo_started=$SECONDS
    podman run --rm --network host "$TAG" python examples/demo.py ||
        die "the demo did not end bit-identical in the image"
    log "demo in $((SECONDS - demo_started)) s"
fi
