#!/usr/bin/env bash
# Predicted vs measured iteration time, before and after calibrating the cost model with the
# runtime's own measurements (docs/perf-archive-2026.md "Predicted vs measured", on
# the CPU backend).
#
# Per mode: compile PIPELINE (datasheet cost model, or PROFILE0 if set), run it on BACKEND with
# `--profile` (the first iteration of every run is warm-up), recompile with the measured
# profile, run the recalibrated plan (and, with REPEAT > 1, both plans alternately), and print
# for both plans the predicted iteration time, the measured median and their ratio.
#
#   scripts/calibrate.sh [PIPELINE.rpx]          default examples/tiny.rpx
# Knobs (environment):
#   BACKEND  cpu | cuda (default cpu)          ITERS  iterations per run (default 6, >= 2)
#   MODES    modes to compile (default "serial overlap")
#   REPEAT   runs of each plan, alternating (default 1; on a shared machine more runs spread
#            the other users' load over both plans)
#   OUT      output directory (default rollplex-out/calibrate)
#   BIN      directory with rollplexc and rollplex-run (default: build them in release into
#            ${CARGO_TARGET_DIR:-target}/release)
#   PROFILE0 profile for the "before" compile (default none: datasheet numbers; for an H200
#            job cost/profiles/h200.yaml is the bench-fitted one)
#   PROFILE1 profile for the "calibrated" compile (default: the one this mode's first run
#            measured). On a backend that co-runs tasks an overlap run measures no time alone
#            for the side tasks (only their slowdowns beside decode): merge it with the serial
#            run's profile (rollplexc merge-profiles) and give it that.
set -euo pipefail
cd "$(dirname "$0")/.."
PIPELINE=${1:-examples/tiny.rpx}
BACKEND=${BACKEND:-cpu}
ITERS=${ITERS:-6}
MODES=${MODES:-serial overlap}
REPEAT=${REPEAT:-1}
OUT=${OUT:-rollplex-out/calibrate}
if [[ -z "${BIN:-}" ]]; then
    cargo build --release -p rollplex-compiler --bin rollplexc -p rollplex-runtime --bin rollplex-run
    BIN="${CARGO_TARGET_DIR:-target}/release"
fi
mkdir -p "$OUT"

# predicted iteration time of a plan, seconds
predicted() { "$BIN/rollplexc" explain "$1" | awk '/^  iteration_s:/ { print $2; exit }'; }
# median of a column of numbers
median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit 1; if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# iteration time_s of the metrics.jsonl files given, each after its first iteration (warm-up)
times() { for f in "$@"; do sed -n 's/.*"time_s":\([0-9.eE+-]*\).*/\1/p' "$f" | tail -n +2; done; }
measured() { times "$@" | median; }
# the same for the time inside tasks (the sum of the four phase times; the rest is the host's
# prompt source and bookkeeping, which no plan predicts)
in_tasks() {
    for f in "$@"; do tail -n +2 "$f"; done | awk '{
        s = 0
        for (i = 1; i <= NF; i++) if ($i ~ /^"(rollout|scoring|training|sync)_s":/) { split($i, kv, ":"); s += kv[2] }
        print s }' FS=',' | median
}

rows=()
for mode in $MODES; do
    d="$OUT/$mode"
    mkdir -p "$d"
    echo "== $mode: compile, run $ITERS iterations on $BACKEND with --profile"
    "$BIN/rollplexc" "$PIPELINE" --mode "$mode" ${PROFILE0:+--profile "$PROFILE0"} \
        -o "$d/before.plan.bin" --emit-yaml "$d/before.plan.yaml"
    "$BIN/rollplex-run" "$d/before.plan.bin" --backend "$BACKEND" --iterations "$ITERS" \
        --out "$d/run-before-1" --profile "$d/profile.yaml" --quiet
    echo "== $mode: recompile with the measured profile; run the plans alternately ($REPEAT runs each)"
    "$BIN/rollplexc" "$PIPELINE" --mode "$mode" --profile "${PROFILE1:-$d/profile.yaml}" \
        -o "$d/after.plan.bin" --emit-yaml "$d/after.plan.yaml"
    for r in $(seq 1 "$REPEAT"); do
        "$BIN/rollplex-run" "$d/after.plan.bin" --backend "$BACKEND" --iterations "$ITERS" \
            --out "$d/run-after-$r" --profile "$d/profile-after-$r.yaml" --quiet
        if ((r < REPEAT)); then
            "$BIN/rollplex-run" "$d/before.plan.bin" --backend "$BACKEND" --iterations "$ITERS" \
                --out "$d/run-before-$((r + 1))" --quiet
        fi
    done
    for when in before after; do
        label=calibrated
        [[ $when == before ]] && label=${PROFILE0:+"$(basename "$PROFILE0")"} && label=${label:-datasheet}
        p=$(predicted "$d/$when.plan.bin")
        m=$(measured "$d"/run-$when-*/metrics.jsonl)
        t=$(in_tasks "$d"/run-$when-*/metrics.jsonl)
        rows+=("$(awk -v mo="$mode" -v w="$label" -v p="$p" -v m="$m" -v t="$t" \
            'BEGIN { printf "%-8s %-22s %10.6f %10.6f %9.3f %10.6f %9.3f", mo, w, p, m, p / m, t, p / t }')")
    done
    # the calibrated prediction against the run that was measured for it (same conditions)
    if [[ -z "${PROFILE1:-}" ]]; then
        m=$(measured "$d/run-before-1/metrics.jsonl")
        t=$(in_tasks "$d/run-before-1/metrics.jsonl")
        rows+=("$(awk -v mo="$mode" -v p="$p" -v m="$m" -v t="$t" \
            'BEGIN { printf "%-8s %-22s %10.6f %10.6f %9.3f %10.6f %9.3f", mo, "calibrated vs run 1", p, m, p / m, t, p / t }')")
    fi
done
echo
echo "$PIPELINE on $BACKEND, $ITERS iterations per run (the first is warm-up; measured: median of the rest)."
echo "Each plan ran $REPEAT time(s), alternately; the calibrated plan was compiled with ${PROFILE1:-the profile the first run of"
echo "the ${PROFILE0:-datasheet} plan wrote} (a profile's header: per kind, measured vs predicted vs fitted)."
echo "in_tasks: the iteration's time inside plan tasks (the rest: prompt source, bookkeeping). Seconds."
echo "\"calibrated vs run 1\": the calibrated plan's prediction against the profiled run alone."
printf '%-8s %-22s %10s %10s %9s %10s %9s\n' mode "plan (cost model)" predicted measured pred/meas in_tasks pred/tasks
printf '%s\n' "${rows[@]}"
