#!/usr/bin/env bash
# Build every cargo-fuzz target once and run each one for a bounded time; exit non-zero on a crash.
#
#   fuzz/smoke.sh                      # every target, 60 s each, as many at a time as there are cores (CI)
#   FUZZ_SECONDS=600 fuzz/smoke.sh     # longer soak
#   FUZZ_TARGETS="pool_ops" fuzz/smoke.sh
#   FUZZ_PARALLEL=1 fuzz/smoke.sh      # one target at a time
#   FUZZ_ARGS="-jobs=2 -workers=2" fuzz/smoke.sh   # extra libFuzzer flags
#
# Builds use cargo-fuzz's default profile: optimised, with debug assertions, overflow checks
# and AddressSanitizer. All targets are built by one cargo invocation before any runs (the
# runs then find them up to date). Each target starts from its committed seeds
# (fuzz/seeds/<target>/) and grows a scratch corpus in fuzz/corpus/<target>/ (git-ignored); a
# crash is written to fuzz/artifacts/<target>/ and printed in readable form.
#
# A libFuzzer run is one process on one core, so FUZZ_PARALLEL targets (default: the number of
# cores, `nproc`) run side by side, each for its full FUZZ_SECONDS: on 2 cores the 9 targets take
# 5 minutes of wall time instead of 9, with the same fuzzing time per target. Each run's output
# goes to its own log, printed in target order once all have finished.
#
# Toolchain: cargo-fuzz needs unstable rustc flags (-Z sanitizer, coverage options). A nightly
# toolchain is used when one is installed; otherwise stable with RUSTC_BOOTSTRAP=1, which
# unlocks the same flags. cargo-fuzz itself is installed when missing.
set -euo pipefail
cd "$(dirname "$0")"

ALL_TARGETS="manager_ops pool_ops hashing_extra_keys block_tables hybrid_ops indexer_events host_tier_ops hybrid_host_ops host_pool_ops"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
TARGETS="${FUZZ_TARGETS:-$ALL_TARGETS}"
PARALLEL="${FUZZ_PARALLEL:-$(nproc 2>/dev/null || echo 1)}"
if ! [[ "$PARALLEL" =~ ^[1-9][0-9]*$ ]]; then
    echo "fuzz-smoke: FUZZ_PARALLEL must be a positive integer, got '$PARALLEL'" >&2
    exit 2
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: cargo-fuzz not found, installing it (cargo install cargo-fuzz --locked)"
    cargo install cargo-fuzz --locked
fi

if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    FUZZ=(cargo +nightly fuzz)
    echo "fuzz-smoke: using the nightly toolchain"
else
    export RUSTC_BOOTSTRAP=1
    FUZZ=(cargo fuzz)
    echo "fuzz-smoke: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1"
fi

# One build for every target: cargo compiles the shared crates once and the targets in parallel.
if [ "$TARGETS" = "$ALL_TARGETS" ]; then
    echo "fuzz-smoke: building every target"
    "${FUZZ[@]}" build
else
    for target in $TARGETS; do
        echo "fuzz-smoke: building $target"
        "${FUZZ[@]}" build "$target"
    done
fi

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# run_target TARGET: one bounded libFuzzer run; its output in $logs/TARGET.log, its exit status
# in $logs/TARGET.rc.
run_target() {
    local target="$1" rc=0
    mkdir -p "corpus/$target" "seeds/$target"
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    "${FUZZ[@]}" run "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 ${FUZZ_ARGS:-} >"$logs/$target.log" 2>&1 || rc=$?
    echo "$rc" >"$logs/$target.rc"
}

echo "fuzz-smoke: running $(wc -w <<<"$TARGETS") target(s) for ${SECONDS_PER_TARGET}s each, $PARALLEL at a time"
running=0
for target in $TARGETS; do
    if [ "$running" -ge "$PARALLEL" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    echo "fuzz-smoke: started $target"
    run_target "$target" &
    running=$((running + 1))
done
wait

status=0
for target in $TARGETS; do
    rc="$(cat "$logs/$target.rc" 2>/dev/null || echo missing)"
    if [ "$rc" = 0 ]; then
        grep -E '^(Done|stat::number_of_executed_units)' "$logs/$target.log" || true
        echo "fuzz-smoke: $target OK"
        continue
    fi
    status=1
    tail -n 60 "$logs/$target.log" 2>/dev/null || true
    crash="$(ls -t "artifacts/$target"/crash-* "artifacts/$target"/leak-* "artifacts/$target"/timeout-* "artifacts/$target"/oom-* 2>/dev/null | head -n 1 || true)"
    if [ -n "$crash" ]; then
        echo "fuzz-smoke: $target FAILED (exit $rc); input $crash decodes to:"
        "${FUZZ[@]}" fmt "$target" "$crash" 2>&1 | tail -n 80 || true
    else
        echo "fuzz-smoke: $target FAILED (exit $rc; see the log above)"
    fi
done
exit "$status"
