#!/usr/bin/env bash
# Pack CRIU and iproute2's `ip`, with the shared libraries the target machine may lack, into a
# folder that can be carried to a machine without packages (the GPU machine):
#   bash scripts/bundle-tools.sh [DEST]        (DEST defaults to ./criu-bundle)
# There: XMIG_CRIU=DEST/criu.sh, and PATH=DEST/bin:$PATH when the machine has no `ip`.
set -euo pipefail
dest=${1:-criu-bundle}
criu=${XMIG_CRIU:-$(command -v criu || true)}
ip=$(command -v ip || true)
[ -x "$criu" ] || { echo "no CRIU here: run scripts/install-criu.sh first" >&2; exit 1; }
[ -x "$ip" ] || { echo "no ip here: install iproute2 first" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/lib" "$dest/bin"
# libraries outside glibc (the target has its own glibc, and mixing them breaks)
copy_libs() {
    ldd "$1" | awk '/=> \//{print $3}' | while read -r lib; do
        case $(basename "$lib") in
            libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
            *) cp -L "$lib" "$dest/lib/" ;;
        esac
    done
}
cp -L "$criu" "$dest/criu"
cp -L "$ip" "$dest/ip"
copy_libs "$dest/criu"
copy_libs "$dest/ip"
cat > "$dest/criu.sh" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu" "$@"
WRAP
cat > "$dest/bin/ip" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/ip" "$@"
WRAP
chmod +x "$dest/criu.sh" "$dest/bin/ip"
"$dest/criu.sh" --version | head -1
"$dest/bin/ip" -V
du -sh "$dest"
