#!/usr/bin/env bash
# Co-run calibration of the cost model on one H200 (predicted vs measured within 10%): the eight plans of examples/h200-3b-video.rpx (serial/overlap x prefix dedup on/off x
# 4/16 prompts) run side by side in one process with their profiles recorded (times alone, and
# for the overlap plans each decode window cut by step into decode alone on its partition and
# decode beside each kind of side work: runtime/src/exec/profile.rs); then, offline, one profile
# is fitted to all eight runs and every plan's measured iteration is set beside what that
# profile predicts for it.
#
# Three modes, in this order:
#
# Entry point for the first two: scripts/gpu-bench.sh build corun, then scripts/gpu-bench.sh run corun.
#
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the binaries: plans and
#      binaries into $DIR (default .gpu-pack/corun, the packed binaries, ignored by git). It runs
#      exactly:
#        export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
#        cargo build --release -p rollplex-compiler --bin rollplexc
#        cargo build --release -p rollplex-runtime --bin rollplex-run --example iteration_bench
#        # per P in $PROMPTS_LIST, dedup on/off: examples/h200-3b-video.rpx with `const PROMPTS`
#        # and `prefix_dedup = off` changed, then per mode:
#        $CARGO_TARGET_DIR/release/rollplexc $DIR/h3b-p$P-$D.rpx --mode $M --profile $PROFILE \
#            -o $DIR/p$P-$M-$D.plan.bin
#        cp $CARGO_TARGET_DIR/release/examples/iteration_bench ...; strip; tar cJf $DIR/bins.tar.xz
#      PROMPTS_LIST (default "4 16") sets the prompt counts.
#      PROFILE (default cost/profiles/h200.yaml, the bench's) only decides the measured plans'
#      placement; the build refuses an overlap plan that puts no side work into a window (it
#      would measure no co-run).
#
#   2. device (on the H200, in the repository root with $DIR beside it): unpacks the binaries and
#      runs `iteration_bench PLANS --iterations 3 --rounds 1 --profile-dir --trace-dir` (models
#      built once, ~45 s; iteration 0 of each plan is warm-up). Plans run smallest first, so a
#      cut-short run still has the 4-prompt ones and the 16-prompt dedup pair; each profile and
#      its line of measured.tsv are written as soon as its plan is done. Measured times give
#      ~280 s for all eight (45 s setup, 4-prompt pairs 25 + 40 s, 16-prompt pairs 48 + 120 s);
#      LIMIT (default 285 s) caps the bench, and a cut loses the last plan, p16-overlap-off.
#      PLANS="..." runs other stems. Results in corun/ (prof/STEM.r0.profile.yaml,
#      prof/measured.tsv, traces/, bench.log, device.txt), brought back as the one file
#      $OUT/corun.tgz (one file for the whole directory).
#        bash runtime/examples/corun_calibrate.sh device
#
#   3. offline RESULTS (on the build machine, after the run; RESULTS is the corun/ directory that
#      `tar xzf corun.tgz` gives,
#      copied to WORK, default rollplex-out/corun-offline, as fetched files may be read-only):
#      merges every profile (rollplexc merge-profiles -> WORK/merged.yaml), then per plan
#      prints the measured median iteration, the plan's own prediction, the measured plan
#      replayed by the simulator with the merged profile (same placement: this is the
#      calibration check) and the plan rollplexc now compiles with the merged profile (its
#      placement may differ: then its measured time is another plan's), each with
#      predicted / measured.
#        bash runtime/examples/corun_calibrate.sh offline /path/to/corun
#
# The binaries of `offline` are this checkout's ($CARGO_TARGET_DIR/release, built by `build`).
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/corun}
PROFILE=${PROFILE:-cost/profiles/h200.yaml}
T=${CARGO_TARGET_DIR:-$PWD/target}/release
# the prompt counts the plans are built for (each: serial/overlap x dedup on/off)
PROMPTS_LIST=${PROMPTS_LIST:-4 16}
# smallest first: see mode 2
if [ -z "${PLANS:-}" ]; then
  PLANS=$(for p in $PROMPTS_LIST; do printf 'p%s-serial-on p%s-overlap-on p%s-serial-off p%s-overlap-off ' $p $p $p $p; done)
fi

die() { echo "corun_calibrate: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

# the pipeline of a plan stem (pP-MODE-D): examples/h200-3b-video.rpx with PROMPTS=P, dedup D
rpx_of() { local p=${1#p}; p=${p%%-*}; echo "$DIR/h3b-p$p-${1##*-}.rpx"; }
mode_of() { local m=${1#*-}; echo "${m%-*}"; }

build() {
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --bin rollplex-run --example iteration_bench
  [ -f "$PROFILE" ] || die "profile $PROFILE not found (set PROFILE=...)"
  mkdir -p "$DIR"
  local src=examples/h200-3b-video.rpx
  grep -q '^const PROMPTS = 16 ' "$src" || die "$src: no 'const PROMPTS = 16' line to change"
  grep -q '^        host_memory = 256GiB$' "$src" || die "$src: no 'host_memory = 256GiB' line to add prefix_dedup after"
  for p in $PROMPTS_LIST; do
    for d in on off; do
      local f=$DIR/h3b-p$p-$d.rpx
      sed -e "s/^const PROMPTS = 16 .*/const PROMPTS = $p/" "$src" > "$f"
      if [ $d = off ]; then
        sed -i 's/^        host_memory = 256GiB$/        host_memory = 256GiB\n        prefix_dedup = off/' "$f"
      fi
      for m in serial overlap; do
        "$T/rollplexc" "$f" --mode $m --profile "$PROFILE" -o "$DIR/p$p-$m-$d.plan.bin" \
          --emit-yaml "$DIR/p$p-$m-$d.plan.yaml" 2>&1 | sed "s|^|p$p-$m-$d: |"
        if [ $m = overlap ] && ! grep -qE '^  side_sms: [1-9]' "$DIR/p$p-$m-$d.plan.yaml"; then
          die "p$p-$m-$d puts no side work into a decode window with $PROFILE: it would measure no co-run"
        fi
      done
    done
  done
  pack_bins "$DIR/bins.tar.xz" "$T/examples/iteration_bench"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run corun"
}

device() {
  local out=$RESULTS_DIR/corun
  local bin=/tmp/corun-bin
  unpack_bins "$DIR/bins.tar.xz" "$bin"
  mkdir -p "$out/prof" "$out/traces"
  { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } \
    > "$out/device.txt" 2>&1 || true
  local plans=()
  for s in $PLANS; do plans+=("$DIR/$s.plan.bin"); done
  local rc=0
  timeout "${LIMIT:-285}" "$bin/iteration_bench" "${plans[@]}" --iterations 3 --rounds 1 \
    --profile-dir "$out/prof" --trace-dir "$out/traces" > "$out/bench.log" 2>&1 || rc=$?
  echo "iteration_bench exit $rc (124: cut at LIMIT=${LIMIT:-285} s; the plans it finished are kept)" \
    | tee -a "$out/bench.log"
  tail -14 "$out/bench.log"
  echo "profiles written: $(ls "$out/prof" | grep -c "profile.yaml$" || true) of $(echo $PLANS | wc -w)"
  pack_results corun
}

offline() {
  local src=${1:-}
  [ -n "$src" ] && [ -f "$src/prof/measured.tsv" ] || die "usage: offline RESULTS (the GPU run's corun/ directory, with prof/measured.tsv)"
  [ -x "$T/rollplexc" ] && [ -x "$T/rollplex-run" ] || die "no binaries in $T: run 'build' first"
  # the fetched results may be read-only: work on a copy
  local r=${WORK:-rollplex-out/corun-offline}
  mkdir -p "$r" && cp -r "$src/prof" "$r/" && chmod -R u+w "$r"
  echo "working in $r"
  local profs=("$r"/prof/*.profile.yaml)
  "$T/rollplexc" merge-profiles "${profs[@]}" -o "$r/merged.yaml"
  mkdir -p "$r/recompiled" "$r/sim"
  printf '\n%-16s %9s %9s %17s %17s %10s\n' plan measured at_build replayed recompiled placement
  local n=0 within=0
  # measured.tsv: STEM ROUND MODE MEDIAN_S PREDICTED_S ITERATIONS...
  while IFS=$'\t' read -r stem _ _ measured built _; do
    local s=${stem%.plan} plan="$DIR/${stem}.bin"
    [ -f "$plan" ] || die "$plan (measured on the device) is not in $DIR"
    local rpx; rpx=$(rpx_of "$s")
    local replay
    replay=$("$T/rollplex-run" "$plan" --backend sim --cost-profile "$r/merged.yaml" \
      --out "$r/sim/$s" 2>&1 | tee "$r/sim/$s.log" \
      | sed -n 's/^predicted iteration time: \([0-9.]*\) s.*/\1/p') || true
    "$T/rollplexc" "$rpx" --mode "$(mode_of "$s")" --profile "$r/merged.yaml" \
      -o "$r/recompiled/$s.plan.bin" 2> "$r/recompiled/$s.log" \
      || die "$s: recompiling failed (see $r/recompiled/$s.log)"
    local again
    again=$(sed -n 's/.*predicted \([0-9.]*\) s\/iteration.*/\1/p' "$r/recompiled/$s.log")
    [ -n "$replay" ] && [ -n "$again" ] || die "$s: no prediction (see $r/sim/$s.log, $r/recompiled/$s.log)"
    local placement=same
    if "$T/rollplexc" diff "$plan" "$r/recompiled/$s.plan.bin" | grep -qE '^(partitions|moved):'; then
      placement=changed
    fi
    awk -v s="$s" -v m="$measured" -v b="$built" -v p="$replay" -v c="$again" -v pl="$placement" \
      'BEGIN { printf "%-16s %8.3fs %8.3fs %8.3fs %6.3fx %8.3fs %6.3fx %10s\n", s, m, b, p, p / m, c, c / m, pl }'
    n=$((n + 1))
    if awk -v m="$measured" -v p="$replay" 'BEGIN { exit !(p / m > 0.9 && p / m < 1.1) }'; then
      within=$((within + 1))
    fi
  done < "$r/prof/measured.tsv"
  echo
  echo "replayed within 10% of measured: $within of $n plans (x: predicted / measured)"
  echo "(at_build: the plan's own prediction, profile $PROFILE; replayed: the measured plan"
  echo " simulated with $r/merged.yaml; recompiled: the plan rollplexc makes with it, whose"
  echo " placement 'changed' means its measured time above is another plan's)"
}

case "$MODE" in
  build) build ;;
  device) device ;;
  offline) shift; offline "$@" ;;
  *) die "usage: $0 build | device | offline RESULTS (see the header)" ;;
esac
