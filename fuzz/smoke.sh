#!/usr/bin/env bash
# Build every cargo-fuzz target and run each one for a bounded time; exit non-zero on a crash.
#
#   fuzz/smoke.sh                      # every target, 60 s each (CI)
#   FUZZ_SECONDS=600 fuzz/smoke.sh     # longer soak
#   FUZZ_TARGETS="pool_ops" fuzz/smoke.sh
#   FUZZ_ARGS="-jobs=2 -workers=2" fuzz/smoke.sh   # extra libFuzzer flags
#
# Builds use cargo-fuzz's default profile: optimised, with debug assertions, overflow checks
# and AddressSanitizer. Each target starts from its committed seeds (fuzz/seeds/<target>/) and
# grows a scratch corpus in fuzz/corpus/<target>/ (git-ignored); a crash is written to
# fuzz/artifacts/<target>/ and printed in readable form.
#
# Toolchain: cargo-fuzz needs unstable rustc flags (-Z sanitizer, coverage options). A nightly
# toolchain is used when one is installed; otherwise stable with RUSTC_BOOTSTRAP=1, which
# unlocks the same flags. cargo-fuzz itself is installed when missing.
set -euo pipefail
cd "$(dirname "$0")"

SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
TARGETS="${FUZZ_TARGETS:-manager_ops pool_ops hashing_extra_keys block_tables hybrid_ops indexer_events host_tier_ops hybrid_host_ops host_pool_ops}"

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

status=0
for target in $TARGETS; do
    mkdir -p "corpus/$target" "seeds/$target"
    echo "fuzz-smoke: building $target"
    "${FUZZ[@]}" build "$target"
    echo "fuzz-smoke: running $target for ${SECONDS_PER_TARGET}s"
    log="$(mktemp)"
    if "${FUZZ[@]}" run "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 ${FUZZ_ARGS:-} >"$log" 2>&1; then
        grep -E '^(Done|stat::number_of_executed_units)' "$log" || true
        echo "fuzz-smoke: $target OK"
    else
        status=1
        tail -n 60 "$log"
        crash="$(ls -t "artifacts/$target"/crash-* "artifacts/$target"/leak-* "artifacts/$target"/timeout-* "artifacts/$target"/oom-* 2>/dev/null | head -n 1 || true)"
        if [ -n "$crash" ]; then
            echo "fuzz-smoke: $target FAILED; input $crash decodes to:"
            "${FUZZ[@]}" fmt "$target" "$crash" 2>&1 | tail -n 80 || true
        else
            echo "fuzz-smoke: $target FAILED (see the log above)"
        fi
    fi
    rm -f "$log"
done
exit "$status"
