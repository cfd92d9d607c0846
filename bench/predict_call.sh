#!/usr/bin/env bash
# Issue 20's time model against the GPU, in one call on a one-GPU machine: measure a calibration
# profile (`parc calibrate --backend cuda`), then for each configuration of a list predict its step
# (`parc check --format json` priced by that profile) and measure it (`parc run`, STEPS steps of
# synthetic data, the median of steps 3..), so prediction and measurement share the call.
#
#   CONFIGS=bench/predict/h200.txt ONLY=regex CALIBRATION=file STEPS=8 bench/predict_call.sh [DIR]
#
# DIR: the binaries bench/device_build.sh built (default .device). CALIBRATION: use this profile
# instead of measuring one. ONLY: run the configurations whose name matches. Output under $OUT
# (else DIR/out): the profile (h200.json), check-NAME.json and run-NAME.jsonl per configuration,
# and the table of bench/predict/summary.py on stdout and in summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
configs=${CONFIGS:-bench/predict/h200.txt}
steps=${STEPS:-8}
t0=$SECONDS
profile=${CALIBRATION:-}
if [[ -z $profile ]]; then
    profile=$out/h200.json
    timeout 300 "$dir/parc" calibrate --backend cuda --gpu h200 -o "$profile" > "$out/calibrate.log" 2>&1
    echo "== calibrate rc=$? at $((SECONDS - t0)) s"
    tail -3 "$out/calibrate.log"
fi
while read -r name spec settings; do
    [[ -z $name || $name == \#* ]] && continue
    [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && continue
    file=$(printf '%s' "$name" | tr '/' '_')
    sets=(--set "train.steps=$steps" --set train.data=synthetic)
    for s in $settings; do sets+=(--set "$s"); done
    "$dir/parc" check "$spec" "${sets[@]}" --calibration "$profile" --format json \
        > "$out/check-$file.json" 2> "$out/check-$file.stderr"
    timeout 150 "$dir/parc" run "$spec" --backend cuda --log-format json "${sets[@]}" \
        --set "train.checkpoint.dir=\"/tmp/parc-predict-$file\"" \
        > "$out/run-$file.jsonl" 2> "$out/run-$file.stderr"
    echo "== $name rc=$? at $((SECONDS - t0)) s"
    rm -rf "/tmp/parc-predict-$file"
done < "$configs"
python3 bench/predict/summary.py "$configs" "$out" | tee "$out/summary.txt"
echo "total $((SECONDS - t0)) s"
