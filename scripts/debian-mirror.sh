#!/usr/bin/env bash
# Sourced by the install scripts: debian_mirror prints the machine's own Debian mirror.
# The first http(s) URI of apt's sources that is not a security mirror, in either the one-line
# format ("deb [opts] URI suite comps") or the deb822 one ("URIs: URI ...").
debian_mirror() {
    if [[ -n "${XMIG_DEBIAN_MIRROR:-}" ]]; then
        echo "${XMIG_DEBIAN_MIRROR%/}"
        return
    fi
    local files=() f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] && files+=("$f")
    done
    ((${#files[@]})) || return 0
    awk '
        /^[[:space:]]*#/ { next }
        /^[[:space:]]*deb(-src)?[[:space:]]/ {
            for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; break }
        }
        /^URIs:/ { for (i = 2; i <= NF; i++) print $i }
    ' "${files[@]}" | grep -E '^https?://' | grep -v -i security | head -n1 | sed 's:/*$::'
}
