#!/usr/bin/env bash
# Issue 20's time model against the GPU, in one call on a one-GPU machine: measure a calibration
# profile (`parc calibrate --backend cuda`), then for each configuration of a list predict its step
# (`parc check --format json` priced by that profile) and measure it (`parc run`, STEPS steps of
# synthetic data, the median of steps 3..), so prediction and measurement share the call.
#
#   CONFIGS=bench/predict/h200.txt ONLY=regex CALIBRATION=file STEPS=6 DEADLINE=420 GPU=kind \
#       bench/predict_call.sh [DIR]
#
# CONFIGS=bench/predict/multi.txt: the 2- and 4-GPU configurations (on a lease of that many
# GPUs; ONLY='^x2/' on two).
#
# DIR: the binaries bench/device_build.sh built (default .device). CALIBRATION: use this profile
# instead of measuring one. GPU: the spec's gpu kind of this machine (default: h200 on an H200,
# h100_80gb on an H100 — the configurations' specs get `cluster.gpu` set to it). ONLY: the configurations whose name matches. DEADLINE: seconds after
# which no configuration starts (the list is in priority order), so the summary is always written.
# Output: $OUT (else DIR/out) gets few files (the device returns at most 8): the profile
# (GPU.json), summary.txt (bench/predict/summary.py's table) and logs.tgz (each configuration's
# check-NAME.json and run-NAME.jsonl/.stderr, the calibration log, clocks.csv: the SM clock and
# power every 200 ms). RUN_ARGS: parc run's extra flags (default `--profile`: each kind's
# measured time beside the timeline's price of it; profiling times on the device's queue).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
configs=${CONFIGS:-bench/predict/h200.txt}
steps=${STEPS:-6}
deadline=${DEADLINE:-420}
work=$(mktemp -d)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)" in
    *H100*) detected=h100_80gb ;;
    *) detected=h200 ;;
esac
gpu=${GPU:-$detected}
t0=$SECONDS
# The time now in nvidia-smi's timestamp format (local time, as its clock log), for the windows
# bench/predict/summary.py reads the clock under load in.
stamp() { date '+%Y/%m/%d %H:%M:%S.%3N'; }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 \
    > "$work/clocks.csv" 2> /dev/null &
smi=$!
trap 'kill $smi 2> /dev/null' EXIT
profile=${CALIBRATION:-}
if [[ -z $profile ]]; then
    profile=$out/$gpu.json
    # CALIBRATE_ARGS: more flags (e.g. `--fp8 none`, `--fp8 blockwise`). The bf16 tables took
    # 89 s on an H100 (69 GEMM shapes × each epilogue, 48 s of it; 2026-12-05), about two
    # minutes with the 107 shapes since; each FP8 scaling about half a minute more:
    # CALIBRATE_S (default 420) bounds it.
    # shellcheck disable=SC2086
    stamp > "$work/window-calibrate.txt"
    timeout "${CALIBRATE_S:-420}" "$dir/parc" calibrate --backend cuda --gpu "$gpu" ${CALIBRATE_ARGS:-} -o "$profile" > "$work/calibrate.log" 2>&1
    rc=$?
    stamp >> "$work/window-calibrate.txt"
    echo "== calibrate rc=$rc at $((SECONDS - t0)) s"
    cat "$work/calibrate.log"
fi
# report: the table and the logs so far into $out (after each configuration: a call cut short
# still brings them back).
report() {
    python3 bench/predict/summary.py "$configs" "$work" > "$out/summary.txt"
    tar czf "$out/logs.tgz" -C "$work" .
}
while read -r name spec settings; do
    [[ -z $name || $name == \#* ]] && continue
    [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && continue
    (( SECONDS - t0 > deadline )) && { echo "== deadline: $name and later not run"; break; }
    file=$(printf '%s' "$name" | tr '/' '_')
    sets=(--set "train.steps=$steps" --set train.data=synthetic --set "cluster.gpu=$gpu")
    for s in $settings; do sets+=(--set "$s"); done
    "$dir/parc" check "$spec" "${sets[@]}" --calibration "$profile" --format json \
        > "$work/check-$file.json" 2> "$work/check-$file.stderr"
    stamp > "$work/window-$file.txt"
    # shellcheck disable=SC2086
    timeout 90 "$dir/parc" run "$spec" --backend cuda --log-format json "${sets[@]}" --calibration "$profile" ${RUN_ARGS---profile} \
        > "$work/run-$file.jsonl" 2> "$work/run-$file.stderr"
    rc=$?
    stamp >> "$work/window-$file.txt"
    echo "== $name rc=$rc at $((SECONDS - t0)) s"
    report
done < "$configs"
report
cat "$out/summary.txt"
echo "total $((SECONDS - t0)) s"
