#!/usr/bin/env bash
# The rootfs the container tests run in, made once where they look for it and kept: the
# folder is named by a digest of what goes into it (make-rootfs.sh, requirements.sh,
# pyproject.toml, TORCH_SPEC), the same one tests/container_harness.py computes.
#
#   sudo bash scripts/test-rootfs.sh          make it unless it is there; print its path
#   bash scripts/test-rootfs.sh --path        print its path only
#
# CI makes it while it installs the rest (.ci/run); the tests make it themselves where it is
# missing. Environment: XMIG_TEST_ROOTFS_CACHE (default /var/tmp), TORCH_SPEC.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT="$(dirname "$HERE")"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
key="$({
    cat "$HERE/make-rootfs.sh" "$HERE/requirements.sh" "$PROJECT/pyproject.toml"
    printf '%s' "$TORCH_SPEC"
} | sha256sum | cut -c1-12)"
folder="${XMIG_TEST_ROOTFS_CACHE:-/var/tmp}/xmig-test-rootfs-$key"

if [[ "${1:-}" == "--path" || -f "$folder/etc/xmig-rootfs" ]]; then
    echo "$folder"
    exit 0
fi
partial="$folder.partial"
rm -rf "$partial"
if ! bash "$HERE/make-rootfs.sh" "$partial" >&2; then
    rm -rf "$partial"
    exit 1
fi
rm -rf "$folder"
mv "$partial" "$folder"
echo "$folder"
