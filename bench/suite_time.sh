#!/usr/bin/env bash
# The test suite's time as CI measures it (`bash .ci/run` on a clean clone of HEAD), optionally with the run held to
# a share of this machine's CPU time, to see how a slower 2-core machine would fare without having one.
#
#   bash bench/suite_time.sh            # uncapped
#   bash bench/suite_time.sh 1.5        # at most 1.5 CPU-seconds per second for the clone's whole .ci/run
#   WARM=1 bash bench/suite_time.sh     # with this machine's test compilation cache (/tmp/t5x_like_test_jax_cache)
#
# By default the run starts, as a fresh machine's does, with an empty JAX compilation cache (its own TMPDIR, where
# tests/conftest.py puts the cache, removed after): on a 2-core machine compiling is then most of the suite's time.
# WARM=1 uses (and fills) the cache earlier runs on this machine left, as a developer's second run does.
#
# The cap is a cgroup CPU quota (v1 `cpu`/`cpuacct`, or v2 `cpu.max`: written to v2's interface, run so far only on
# v1; 10 ms periods; needs root). A quota slows only what wants more CPU than it allows, so it is not a slower core:
# compare the capped run's test time with an uncapped run of the same commit on the same machine (the ratio is the
# slower machine it stands for), and name the CPU.
# Prints the commit, the CPU model, pytest's summary line, the wall time and the CPU-seconds the run used; keeps
# the log (with pytest's 30 slowest tests), removes the clone.
set -euo pipefail
{  # read whole before it runs: the script may be edited while a run (10+ minutes) goes on
CPUS="${1:-}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d /tmp/suite_time.XXXXXX)"
git clone -q "$REPO" "$WORK/clone"
NAME="suite_time_$$"
if [ -d /sys/fs/cgroup/cpu ] && [ -d /sys/fs/cgroup/cpuacct ]; then  # cgroup v1
  CPU_GROUP="/sys/fs/cgroup/cpu/$NAME" ACCT_GROUP="/sys/fs/cgroup/cpuacct/$NAME"
  mkdir "$CPU_GROUP" "$ACCT_GROUP"
  if [ -n "$CPUS" ]; then
    echo 10000 > "$CPU_GROUP/cpu.cfs_period_us"
    quota=$(python3 -c "print(round(10000 * $CPUS))")
    echo "$quota" > "$CPU_GROUP/cpu.cfs_quota_us"
  fi
  usage_seconds() { python3 -c "print(round(int(open('$ACCT_GROUP/cpuacct.usage').read()) / 1e9, 1))"; }
  throttled() { awk '/^nr_periods|^nr_throttled/ {printf "%s %s ", $1, $2}' "$CPU_GROUP/cpu.stat"; }
  cleanup() { rmdir "$CPU_GROUP" "$ACCT_GROUP" 2>/dev/null || true; }
else  # cgroup v2
  CPU_GROUP="/sys/fs/cgroup/$NAME" ACCT_GROUP=""
  echo +cpu > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
  mkdir "$CPU_GROUP"
  if [ -n "$CPUS" ]; then quota=$(python3 -c "print(round(10000 * $CPUS))"); echo "$quota 10000" > "$CPU_GROUP/cpu.max"; fi
  usage_seconds() { awk '/^usage_usec/ {printf "%.1f\n", $2 / 1e6}' "$CPU_GROUP/cpu.stat"; }
  throttled() { awk '/^nr_periods|^nr_throttled/ {printf "%s %s ", $1, $2}' "$CPU_GROUP/cpu.stat"; }
  cleanup() { rmdir "$CPU_GROUP" 2>/dev/null || true; }
fi
trap 'cleanup; rm -rf "$WORK/clone" "$WORK/tmp"' EXIT  # the log stays

echo "commit $(git -C "$WORK/clone" log --oneline -1)"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores," \
     "$(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -c avx512) avx512 flags; cap: ${CPUS:-none}${CPUS:+ CPUs}"
mkdir "$WORK/tmp"
CACHE="$([ -n "${WARM:-}" ] && echo "${TMPDIR:-/tmp}" || echo "$WORK/tmp")/t5x_like_test_jax_cache"
entries() { if [ -d "$CACHE" ]; then ls "$CACHE" | wc -l; else echo 0; fi; }
echo "compilation cache $CACHE: $(entries) entries at the start"
start=$(date +%s)
set +e
(
  for group in "$CPU_GROUP" $ACCT_GROUP; do echo $BASHPID > "$group/cgroup.procs"; done
  [ -n "${WARM:-}" ] || export TMPDIR="$WORK/tmp"
  cd "$WORK/clone" && exec bash .ci/run
) > "$WORK/LOG" 2>&1
status=$?
set -e
end=$(date +%s)
grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$WORK/LOG" | tail -1 || true
echo "exit $status; .ci/run wall $((end - start)) s; CPU $(usage_seconds) s; $(throttled)"
echo "compilation cache: $(entries) entries at the end"
echo "log: $WORK/LOG"
exit $status
}
