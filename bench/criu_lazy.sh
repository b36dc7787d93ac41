#!/usr/bin/env bash
# CRIU's lazy restore against its plain restore, for one process holding MIB MiB of memory,
# dumped into a tmpfs and restored on the same machine (the same PID, as a migration keeps it):
#
#     bash bench/criu_lazy.sh [MIB ...]        (root; CRIU >= 4.2 on PATH or in $XMIG_CRIU)
#
# Per size and mode: the dump, the restore (until criu returns: the process runs again), and
# the process's first read of all its memory after that (its pages come through userfaultfd
# from `criu lazy-pages` in the lazy mode). Every run checks the memory's digest.
set -euo pipefail
CRIU=${XMIG_CRIU:-criu}
BOUND=120  # seconds any one criu command may take
WORK=$(mktemp -d /dev/shm/xmig-lazy.XXXXXX)
HOLDER=""
DAEMON=""
cleanup() {
    [[ -n $HOLDER ]] && kill -9 "$HOLDER" 2>/dev/null || true
    # (TERM: timeout hands it on to criu lazy-pages)
    [[ -n $DAEMON ]] && kill "$DAEMON" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

HOLD="$(cd "$(dirname "$0")" && pwd)/memory_holder.py"

now() { date +%s%N; }  # nanoseconds
seconds() { printf '%d.%03d' $(($1 / 1000000000)) $(($1 / 1000000 % 1000)); }
wait_for() {  # wait_for TEST-ARGS... : at most 60 s
    local deadline=$((SECONDS + 60))
    until test "$@"; do
        ((SECONDS < deadline)) || { echo "criu_lazy: timed out waiting for $*" >&2; exit 1; }
        sleep 0.005
    done
}

one() {  # one MIB MODE
    local mib=$1 mode=$2 images="$WORK/images"
    rm -rf "$images" "$WORK"/{ready,go,done}
    mkdir -p "$images"
    setsid python3 "$HOLD" "$WORK" "$mib" </dev/null >"$WORK/hold.out" 2>&1 &
    wait_for -f "$WORK/ready"
    HOLDER=$(cat "$WORK/ready")
    local t0 t1 t2 t3
    t0=$(now)
    timeout "$BOUND" "$CRIU" dump -t "$HOLDER" -D "$images" -o dump.log -v2
    t1=$(now)
    if [[ $mode == lazy ]]; then
        timeout "$BOUND" "$CRIU" lazy-pages -D "$images" -o lazy.log -v2 &
        DAEMON=$!
        wait_for -S "$images/lazy-pages.socket"
        timeout "$BOUND" "$CRIU" restore -D "$images" -o restore.log -v2 -d --lazy-pages
    else
        timeout "$BOUND" "$CRIU" restore -D "$images" -o restore.log -v2 -d
    fi
    t2=$(now)
    touch "$WORK/go"
    wait_for -f "$WORK/done"
    t3=$(now)
    read -r same _ <"$WORK/done" || true  # (no newline at its end)
    printf '| %s | %s | %s | %s | %s | %s |\n' "$mib" "$mode" "$(seconds $((t1 - t0)))" \
        "$(seconds $((t2 - t1)))" "$(seconds $((t3 - t2)))" "$same"
    if [[ -n $DAEMON ]]; then
        wait "$DAEMON" 2>/dev/null || true
        DAEMON=""
    fi
    kill -9 "$HOLDER" 2>/dev/null || true
    HOLDER=""
}

echo "| MiB | restore | dump s | restore s | first read of all memory s | intact |"
echo "|---|---|---|---|---|---|"
for mib in "${@:-512}"; do
    one "$mib" plain
    one "$mib" lazy
    one "$mib" lazy
    one "$mib" plain
done
