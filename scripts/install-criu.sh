#!/usr/bin/env bash
# Install CRIU >= 4.2 on Debian: build Debian's own CRIU source tarball and install one binary.
#
# Older CRIU does not work on recent kernels (3.17 cannot start on >= 6.13, 4.1 cannot dump a
# process holding an IPv4 socket on >= 6.16). The tarball comes from the machine's configured
# Debian mirror; its sha256 is checked against the archive's Sources index, whose own sha256 is
# checked against the suite's InRelease file, whose signature is checked with Debian's keyring.
#
# Environment:
#   XMIG_CRIU_PREFIX    install prefix (default /usr/local: the binary goes to PREFIX/sbin/criu)
#   XMIG_CRIU_VERSION   upstream version to build (default 4.2.1)
#   XMIG_CRIU_SUITES    suites searched for that version (default "trixie-backports forky sid")
#   XMIG_DEBIAN_MIRROR  Debian mirror base URL (default: the first one in apt's sources)
set -euo pipefail

MIN_VERSION=4.2
CRIU_VERSION="${XMIG_CRIU_VERSION:-4.2.1}"
PREFIX="${XMIG_CRIU_PREFIX:-/usr/local}"
DEST="$PREFIX/sbin/criu"
SUITES="${XMIG_CRIU_SUITES:-trixie-backports forky sid}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
BUILD_DEPS=(
    build-essential pkg-config xz-utils gpgv debian-archive-keyring
    libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev libnl-3-dev
    libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev
)

log() { echo "install-criu: $*"; }
die() {
    echo "install-criu: ERROR: $*" >&2
    exit 1
}

# version_ge A B: true when version A >= version B.
version_ge() {
    [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" == "$2" ]]
}

# criu_version BINARY: print the version BINARY reports (empty when it does not run).
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1 || true
}

# --- already installed? -----------------------------------------------------------------------
candidates=()
if on_path="$(command -v criu 2>/dev/null)"; then candidates+=("$on_path"); fi
candidates+=("$DEST")
for bin in "${candidates[@]}"; do
    [[ -x "$bin" ]] || continue
    v="$(criu_version "$bin")"
    if [[ -n "$v" ]] && version_ge "$v" "$MIN_VERSION"; then
        log "CRIU $v already usable at $bin; nothing to do"
        exit 0
    fi
    if [[ -n "$v" ]]; then
        log "found CRIU $v at $bin: older than $MIN_VERSION, building $CRIU_VERSION"
    fi
done

[[ "$(id -u)" -eq 0 ]] || die "must run as root (installs packages and $DEST)"
command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian only"

start=$SECONDS
export DEBIAN_FRONTEND=noninteractive

# --- build dependencies -----------------------------------------------------------------------
missing=()
for pkg in "${BUILD_DEPS[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "installing build dependencies: ${missing[*]}"
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    log "build dependencies already installed"
fi

# --- mirror -----------------------------------------------------------------------------------
# shellcheck source=scripts/debian-mirror.sh
source "$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh"
MIRROR="$(debian_mirror)"
[[ -n "$MIRROR" ]] || die "no Debian mirror found in apt's sources (set XMIG_DEBIAN_MIRROR)"
log "Debian mirror: $MIRROR"

WORK="$(mktemp -d -t xmig-criu.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# apt-helper downloads as user _apt where it can: give it a folder it may write to
DL="$WORK/dl"
mkdir "$DL"
chmod 755 "$WORK"
if id _apt >/dev/null 2>&1; then chown _apt "$DL"; fi

# fetch URL FILE: download with apt's own downloader (apt's proxy settings apply).
fetch() {
    /usr/lib/apt/apt-helper download-file "$1" "$DL/${2##*/}" >/dev/null ||
        die "download failed: $1"
    mv -f "$DL/${2##*/}" "$2"
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# --- find the version in a suite's signed Sources index ----------------------------------------
tarball="criu_${CRIU_VERSION}.orig.tar.xz"
want_sha=""
for suite in $SUITES; do
    log "looking for criu $CRIU_VERSION in $suite"
    dists="$MIRROR/dists/$suite"
    if ! /usr/lib/apt/apt-helper download-file "$dists/InRelease" "$DL/InRelease" \
        >/dev/null 2>&1; then
        log "  $suite: no InRelease on this mirror, skipping"
        continue
    fi
    mv -f "$DL/InRelease" "$WORK/InRelease"
    gpgv --keyring "$KEYRING" --output "$WORK/Release" "$WORK/InRelease" 2>"$WORK/gpgv.log" ||
        die "bad signature on $dists/InRelease: $(tail -n3 "$WORK/gpgv.log")"
    sources_sha="$(awk '/^SHA256:/ { s = 1; next } /^[^ ]/ { s = 0 }
        s && $3 == "main/source/Sources.xz" { print $1 }' "$WORK/Release")"
    [[ -n "$sources_sha" ]] || die "$suite's Release lists no main/source/Sources.xz"
    fetch "$dists/main/source/Sources.xz" "$WORK/Sources.xz"
    got="$(sha256_of "$WORK/Sources.xz")"
    [[ "$got" == "$sources_sha" ]] ||
        die "sha256 mismatch for $suite Sources.xz: got $got, Release says $sources_sha"
    # the criu stanza: its Version, Directory and the tarball's Checksums-Sha256 line
    version="" directory="" sha=""
    read -r version directory sha < <(xz -dc "$WORK/Sources.xz" | awk -v tb="$tarball" '
        /^Package: / { p = ($2 == "criu"); v = ""; d = ""; h = ""; s = 0 }
        p && /^Version: / { v = $2 }
        p && /^Directory: / { d = $2 }
        p && /^[^[:space:]]/ { s = ($1 == "Checksums-Sha256:") }
        p && s && $3 == tb { h = $1 }
        p && /^$/ { if (h != "") { print v, d, h; exit } p = 0 }
        END { if (p && h != "") print v, d, h }
    ' || true) || true
    rm -f "$WORK/Sources.xz"
    if [[ -n "$sha" ]]; then
        log "  $suite has criu $version"
        want_sha="$sha"
        break
    fi
    log "  $suite: no criu $CRIU_VERSION"
done
[[ -n "$want_sha" ]] || die "criu $CRIU_VERSION is in none of: $SUITES (on $MIRROR)"

# --- download and verify the tarball ---------------------------------------------------------
log "downloading $MIRROR/$directory/$tarball"
fetch "$MIRROR/$directory/$tarball" "$WORK/$tarball"
got="$(sha256_of "$WORK/$tarball")"
[[ "$got" == "$want_sha" ]] || die "sha256 mismatch for $tarball: got $got, expected $want_sha"
log "sha256 ok: $got"

# --- build and install ------------------------------------------------------------------------
tar -xJf "$WORK/$tarball" -C "$WORK"
src="$WORK/criu-$CRIU_VERSION"
[[ -d "$src" ]] || die "unexpected tarball layout (no criu-$CRIU_VERSION/)"
jobs="$(nproc 2>/dev/null || echo 2)"
log "building (make -j$jobs criu)"
if ! make -C "$src" -j"$jobs" criu >"$WORK/build.log" 2>&1; then
    tail -n 40 "$WORK/build.log" >&2
    die "build failed"
fi
install -D -m 0755 "$src/criu/criu" "$DEST.new"
mv -f "$DEST.new" "$DEST"
v="$(criu_version "$DEST")"
if [[ -z "$v" ]] || ! version_ge "$v" "$MIN_VERSION"; then
    die "installed $DEST reports version '$v', not >= $MIN_VERSION"
fi
log "installed CRIU $v at $DEST in $((SECONDS - start)) s"
if check="$("$DEST" check 2>&1)"; then
    log "criu check: $(echo "$check" | tail -n1)"
else
    log "warning: criu check failed on this kernel:"
    echo "$check" | tail -n5 >&2
fi
if [[ "$(command -v criu || true)" != "$DEST" ]]; then
    log "note: $DEST is not the criu first on PATH; xmig finds it with XMIG_CRIU=$DEST"
fi
