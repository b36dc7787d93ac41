#!/usr/bin/env bash
# The cooperating worker's migration route, measured by hand on one GPU:
#   XMIG_CRIU=criu-bundle/criu.sh bash bench/gpu_shm_criu.sh GIB
# A process moves GIB GiB of GPU memory into a registered /dev/shm file itself and frees it
# (bench/gpu_shm_hold.py); then the driver's checkpoint (xmig.migrate.cuda), a CRIU dump (a
# shared file mapping is kept by reference, its pages are not copied), a CRIU restore of the
# same PID, the driver's restore onto the same GPU, and the copy back. Prints each phase's
# seconds, the image's size, and whether every byte came back. Run from the repository's root,
# as root; every process it started is ended by PID.
set -u
criu=${XMIG_CRIU:-criu}
size=${1:-1}
work=$(mktemp -d /tmp/xmig-shm-criu-XXXXXX)
shm=/dev/shm/xmig-shm-criu-$$
mkdir -p "$work/img"
setsid python bench/gpu_shm_hold.py "$size" "$shm" "$work/flag" >"$work/hold.log" 2>&1 </dev/null &
for _ in $(seq 1 240); do grep -q ready "$work/hold.log" && break; sleep 0.5; done
pid=$(awk '/^ready/{print $3}' "$work/hold.log")
cleanup() { [ -n "${pid:-}" ] && kill -9 "$pid" 2>/dev/null; rm -f "$shm"; rm -rf "$work"; }
trap cleanup EXIT
[ -n "$pid" ] || { cat "$work/hold.log"; exit 1; }
cat "$work/hold.log"
now() { date +%s.%N; }
t0=$(now)
PYTHONPATH=src python -c "from xmig.migrate.cuda import GpuCheckpoint; GpuCheckpoint($pid).save()"
t1=$(now)
"$criu" dump -t "$pid" -D "$work/img" --shell-job -o dump.log || { tail "$work/img/dump.log"; exit 1; }
t2=$(now)
image=$(du -sm "$work/img" | cut -f1)
"$criu" restore -D "$work/img" --shell-job -d -o restore.log || { tail "$work/img/restore.log"; exit 1; }
t3=$(now)
PYTHONPATH=src python -c "from xmig.migrate.cuda import GpuCheckpoint; GpuCheckpoint($pid).load()"
t4=$(now)
touch "$work/flag.go"
for _ in $(seq 1 120); do [ -f "$work/flag.done" ] && break; sleep 0.25; done
python3 -c "print('GiB $size: GPU checkpoint %.3f s, dump %.3f s (image $image MB), restore %.3f s, GPU restore %.3f s' % ($t1-$t0, $t2-$t1, $t3-$t2, $t4-$t3))"
cat "$work/flag.done"
