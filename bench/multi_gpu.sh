#!/usr/bin/env bash
# Issue 8 on one multi-GPU host (nvidia-h200-x2/x4/x8): every parallel axis through NCCL against the
# one-GPU run, parc's own collective bandwidth, data-parallel weak scaling, tensor and pipeline
# parallel throughput and bubble, and ZeRO memory against `parc check`'s per-GPU prediction; each
# phase selectable, every call held to a time budget.
#
# A full pass on 8 GPUs is three device calls of at most 9 minutes (docs/launch.md has them;
# estimated from the x2/x4 runs' per-run seconds: ~330 s, ~405 s, ~220 s):
#   PHASES="correctness bandwidth scaling" bench/multi_gpu.sh
#   PHASES="zero tp" bench/multi_gpu.sh
#   PHASES="pp" bench/multi_gpu.sh
# then, here, `bench/parity/multi_gpu_summary.py CALL1/multi-gpu CALL2/multi-gpu CALL3/multi-gpu`
# prints issue 8's acceptance lines over all three.
#   BACKEND=cpu NGPU=2 bench/multi_gpu.sh    the plumbing dry run, here: the CPU backend, ranks as
#                                            threads of one process, tiny specs (see DRY below)
#   CHECK_ONLY=1 NGPU=8 bench/multi_gpu.sh   only `parc check` every plan the real run would use
#
# Phases (PHASES, default "correctness bandwidth scaling tp pp zero"):
#   correctness  the cuda_nccl test binary's multi-GPU test (GPU only), then examples/tiny.par for
#                dp, tp, tp+sp, pp (1F1B, GPipe, interleaved), cp, ZeRO 1-3 and mixed plans with
#                2, 4 and 8 ranks (those that fit NGPU), each through --nproc-per-node, every
#                step's loss against the one-GPU run's within TOLERANCE (1e-2 relative, bf16)
#   bandwidth    `cuda_nccl nccl_bus_bandwidth --ignored` (all-reduce, all-gather, reduce-scatter
#                1 MB..4 GB over all GPUs through parc's own backend), best busbw against 370 GB/s
#   scaling      GPT-2 124M (32 × 1024 per GPU) and 350M (16 × 1024 per GPU), dp 1 → 2 → 4 → 8
#                (up to NGPU), tokens/s and efficiency against n × the one-GPU rate (goal ≥ 95%)
#   tp, pp       examples/gpt2-1.5b-8gpu.par at d 1536 / 24 heads (25 heads do not divide by tp;
#                1.4B parameters, head dim 64), tp 2/4/8 and pp 2/4 in 1F1B and interleaved (2
#                chunks per rank), tokens/s and MFU; pp runs profile their last step: the report
#                rank's (last stage's) device-timed share waiting in pipeline transfers is the
#                measured bubble, against (p−1)/(m+p−1) (interleaved: (p−1)/(v·m+p−1))
#   zero         GPT-2 350M dp NGPU (at most 8) with ZeRO 0/1/2/3: nvidia-smi's peak memory per
#                GPU (every GPU sampled each 100 ms; the processes on each GPU each 500 ms, to
#                catch a stray context) against `parc check`'s per-GPU prediction, and the run's
#                memory_reserved_bytes against check's prediction of it; NCCL logs its channels
#                (NCCL_DEBUG=INFO, INIT) into the runs' stderr
# Every `--set` combination is first checked with `parc check --format json`; an invalid one is
# logged as such and skipped. NCCL_NVLS_ENABLE=0 for every run.
#
# Time budget: TOTAL (seconds, default 510) for the whole call. Before each run the script
# estimates its seconds (per-run figures of the x2/x4 calls, scaled by ranks: est_seconds below);
# a run that would end past TOTAL is not started but logged as skipped (runs.jsonl skipped=1), and
# the summary names every skipped run with the command that runs them (ONLY="names…"). Each run's
# timeout is the smaller of PHASE_TIMEOUT and the time left.
#
# Environment: PARC (.device/parc), NCCL_TEST (.device/cuda_nccl), PYTHON (python3), NGPU (GPUs
# to use; default nvidia-smi's count), BACKEND (cuda | cpu), STEPS (scaling/tp/pp/zero steps, 8),
# CORRECT_STEPS (20), TOLERANCE (1e-2), PHASE_TIMEOUT (seconds per run, 300), TOTAL (510),
# ONLY (run names: run only these, of the selected phases), DRY (1 when BACKEND=cpu: every model
# spec is examples/tiny.par at small batches, no nvidia-smi, no tests), CHECK_ONLY (1: check the
# plans, run nothing; needs no GPU).
# Output: $OUT/multi-gpu/ (or .device/out/multi-gpu/): runs.jsonl (one line per run), each run's
# NAME.jsonl / NAME.stderr / NAME.smi / NAME.apps / NAME-check.json, bandwidth.txt, summary.txt,
# summary.json.
# Exit: 0 when every run finished, every loss matched and no acceptance line failed, 1
# otherwise, 2 on setup errors.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh

parc="${PARC:-.device/parc}"
nccl_test="${NCCL_TEST:-.device/cuda_nccl}"
python="${PYTHON:-python3}"
phases="${PHASES:-correctness bandwidth scaling tp pp zero}"
backend="${BACKEND:-cuda}"
dry="${DRY:-$([[ $backend == cpu ]] && echo 1 || echo 0)}"
check_only="${CHECK_ONLY:-0}"
steps="${STEPS:-8}"
correct_steps="${CORRECT_STEPS:-20}"
tolerance="${TOLERANCE:-1e-2}"
phase_timeout="${PHASE_TIMEOUT:-300}"
total="${TOTAL:-510}"
only="${ONLY:-}"
out="${OUT:-.device/out}/multi-gpu"
mkdir -p "$out"
: > "$out/runs.jsonl"

if [[ ! -x "$parc" ]]; then
    echo "error: no parc binary at $parc: build it with cargo build --release --features cuda and copy it there, or set PARC" >&2
    exit 2
fi
if [[ "$dry" != 1 && "$check_only" != 1 ]] && ! command -v nvidia-smi >/dev/null; then
    echo "error: nvidia-smi is missing: this script runs on the GPU machine (or set BACKEND=cpu for the dry run)" >&2
    exit 2
fi
ngpu="${NGPU:-$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU')}"
if [[ -z "$ngpu" || "$ngpu" -lt 1 ]]; then
    echo "error: no GPU found (nvidia-smi --list-gpus); set NGPU" >&2
    exit 2
fi
scratch="$(mktemp -d)"
samplers=()
stop_samplers() {
    local pid
    for pid in "${samplers[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
    samplers=()
}
trap 'stop_samplers; rm -rf "$scratch"' EXIT
link_nccl "$scratch/nccl"
{
    echo "multi-gpu: $ngpu GPU(s), backend $backend, phases: $phases, parc $parc, budget ${total} s"
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
    if [[ "$dry" != 1 && "$check_only" != 1 ]]; then
        nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
        nvidia-smi topo -m
    fi
} 2>&1 | tee "$out/machine.txt"

# Specs: the dry run swaps every model for examples/tiny.par (the CPU trains GPT-2 too slowly).
if [[ "$dry" == 1 ]]; then
    spec_124m=examples/tiny.par; spec_350m=examples/tiny.par; spec_xl=examples/tiny.par
    batch_124m=4; batch_350m=2; xl_shape=(--set model.layers=8); xl_micro=2  # 8 layers: pp 4 × 2 chunks
    precision=fp32
    shape_124m=(layers=4 d=64 seq=64); shape_350m=("${shape_124m[@]}"); shape_xl=(layers=8 d=64 seq=64)
else
    spec_124m=examples/gpt2-124m.par; spec_350m=examples/gpt2-350m.par
    spec_xl=examples/gpt2-1.5b-8gpu.par
    batch_124m=32; batch_350m=16; xl_shape=(--set model.d=1536 --set model.heads=24); xl_micro=4
    precision=bf16
    shape_124m=(layers=12 d=768 seq=1024); shape_350m=(layers=24 d=1024 seq=1024)
    shape_xl=(layers=48 d=1536 seq=1024)
fi

status=0
# log_run NAME PHASE RANKS EXIT SECONDS KEY=VALUE...: one line of runs.jsonl
log_run() {
    local name="$1" phase="$2" ranks="$3" code="$4" secs="$5"; shift 5
    "$python" - "$name" "$phase" "$ranks" "$code" "$secs" "$@" >> "$out/runs.jsonl" <<'EOF'
import json, sys
name, phase, ranks, code, secs = sys.argv[1:6]
extra = dict(kv.split("=", 1) for kv in sys.argv[6:])
print(json.dumps(dict(name=name, phase=phase, ranks=int(ranks), exit=int(code), seconds=int(secs), **extra)))
EOF
}

# start_sampler NAME: sample every GPU's memory.used each 100 ms into NAME.smi ("index, MiB"
# lines; the block before "---" is the reading before the run) and the processes holding memory
# on each GPU each 500 ms into NAME.apps ("pid, bus id, MiB" lines, samples separated by "---");
# the samplers' pids go to $samplers (nothing in the dry run; stop_samplers ends them).
start_sampler() {
    local name="$1"
    [[ "$dry" == 1 ]] && return
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits > "$out/$name.smi"
    echo "---" >> "$out/$name.smi"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 100 >> "$out/$name.smi" &
    samplers=($!)
    (while true; do
        nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader,nounits
        echo "---"
        sleep 0.5
    done) > "$out/$name.apps" 2>/dev/null &
    samplers+=($!)
}

# est_seconds NAME RANKS: the expected seconds of one run, from the per-run seconds of the x2 and
# x4 calls (bench/RESULTS.md, session 3; .device/{3,8}/multi-gpu/runs.jsonl): start-up grows
# with the ranks (processes, NCCL set-up, each rank's parameter initialisation). The 1.4B runs
# have no measurement yet: 350M's scaled by its 4× parameters.
est_seconds() {
    local name="$1" n="$2"
    case "$name" in
        tiny-*) echo $((2 + 6 * n / 5)) ;;
        cuda_nccl-multi) echo $((5 + 5 * n / 2)) ;;
        bandwidth) echo $((2 + 3 * n / 2)) ;;
        scale-124m-*) echo $((3 + 11 * n / 4)) ;;
        scale-350m-*) echo $((7 + 6 * n)) ;;
        zero*) echo $((8 + 6 * n)) ;;
        xl-tp*) echo $((30 + 4 * n)) ;;
        xl-pp*) echo $((40 + 5 * n)) ;;
        *) echo 30 ;;
    esac
}

# budget_allows NAME PHASE RANKS: whether the run is selected (ONLY) and fits the budget; a run
# that does not fit is logged as skipped. Sets $run_timeout for the run.
budget_allows() {
    local name="$1" phase="$2" ranks="$3"
    if [[ -n "$only" && " $only " != *" $name "* ]]; then return 1; fi
    [[ "$check_only" == 1 ]] && return 0
    local left=$((total - SECONDS)) need
    need=$(est_seconds "$name" "$ranks")
    if [[ "$left" -lt "$need" ]]; then
        echo "$name: skipped: about $need s needed, $left s of the ${total} s budget left"
        log_run "$name" "$phase" "$ranks" 4 0 skipped=1
        return 1
    fi
    run_timeout=$((left < phase_timeout ? left : phase_timeout))
    return 0
}

# parc_run NAME PHASE RANKS SPEC SETS...: `parc check` the plan, then `parc run` it on RANKS
# GPUs (one process per rank through --nproc-per-node; threads in the dry run), with the run-only
# flags in the array run_flags; the array shape (layers=… d=… seq=…, for MFU) goes to runs.jsonl.
run_flags=(); shape=(); run_env=()
run_timeout="$phase_timeout"
parc_run() {
    local name="$1" phase="$2" ranks="$3" spec="$4"; shift 4
    budget_allows "$name" "$phase" "$ranks" || return 0
    local sets=("$@" --set "cluster.gpus_per_node=$ranks" --set "train.checkpoint.dir=\"$scratch/ckpt-$name\"")
    if ! "$parc" check "$spec" "${sets[@]}" --format json > "$out/$name-check.json" 2> "$out/$name-check.stderr"; then
        echo "$name: invalid plan, skipped: $(grep -m1 -o '"message": *"[^"]*"' "$out/$name-check.json")"
        log_run "$name" "$phase" "$ranks" 3 0 invalid=1
        status=1
        return
    fi
    if [[ "$check_only" == 1 ]]; then
        echo "$name: valid"
        return
    fi
    local launch=()
    if [[ "$dry" != 1 && "$ranks" -gt 1 ]]; then launch=(--nproc-per-node "$ranks"); fi
    start_sampler "$name"
    local started=$SECONDS
    env "${run_env[@]}" timeout "$run_timeout" "$parc" run "$spec" "${sets[@]}" --backend "$backend" \
        --log-format json "${launch[@]}" "${run_flags[@]}" > "$out/$name.jsonl" 2> "$out/$name.stderr"
    local code=$?
    stop_samplers
    rm -rf "$scratch/ckpt-$name"
    echo "$name: $ranks rank(s), exit $code after $((SECONDS - started)) s (estimated $(est_seconds "$name" "$ranks") s)"
    if [[ $code -ne 0 ]]; then tail -5 "$out/$name.stderr"; status=1; fi
    log_run "$name" "$phase" "$ranks" "$code" "$((SECONDS - started))" spec="$spec" "${shape[@]}" \
        $(budget_cut "$code")
}

# budget_cut EXIT: "budget_cut=1" when a run was killed by a timeout shortened to the budget's
# remainder (the summary treats it as skipped, not failed).
budget_cut() {
    if [[ "$1" -eq 124 && "$run_timeout" -lt "$phase_timeout" ]]; then echo budget_cut=1; fi
}

has_phase() { [[ " $phases " == *" $1 "* ]]; }

if has_phase correctness; then
    echo "== correctness"
    if [[ "$dry" != 1 && "$check_only" != 1 ]] && budget_allows cuda_nccl-multi correctness "$ngpu"; then
        if [[ -x "$nccl_test" ]]; then
            started=$SECONDS
            PARC_BIN="$(realpath "$parc")" timeout "$run_timeout" "$nccl_test" \
                multi_gpu_plans_through_nccl_match_the_single_rank_cpu_run --nocapture \
                > "$out/cuda_nccl-multi.txt" 2>&1
            code=$?
            echo "cuda_nccl multi_gpu_plans_through_nccl_match_the_single_rank_cpu_run: exit $code"
            [[ $code -ne 0 ]] && { tail -15 "$out/cuda_nccl-multi.txt"; status=1; }
            log_run cuda_nccl-multi correctness "$ngpu" "$code" "$((SECONDS - started))" test=1 \
                $(budget_cut "$code")
        else
            echo "no test binary at $nccl_test: build it (cargo test --release --features cuda --test cuda_nccl --no-run) and copy it there, or set NCCL_TEST"
            log_run cuda_nccl-multi correctness "$ngpu" 127 0 test=1
            status=1
        fi
    fi
    tiny=(--set "train.steps=$correct_steps" --set "train.precision=$precision" --set train.log_every=1)
    parc_run tiny-1gpu correctness 1 examples/tiny.par "${tiny[@]}"
    # one plan a line: NAME RANKS SETTINGS (plans of more ranks than NGPU are left out)
    plans=(
        "dp2 2 parallel.dp=2"
        "dp2-zero1 2 parallel.dp=2 parallel.zero=1"
        "dp2-zero2 2 parallel.dp=2 parallel.zero=2"
        "dp2-zero3 2 parallel.dp=2 parallel.zero=3"
        "tp2 2 parallel.tp=2"
        "tp2-sp 2 parallel.tp=2 parallel.sequence_parallel=true"
        "pp2-1f1b 2 parallel.pp=2 parallel.schedule=1f1b"
        "pp2-gpipe 2 parallel.pp=2 parallel.schedule=gpipe"
        "pp2-interleaved 2 parallel.pp=2 parallel.schedule=interleaved"
        "cp2 2 parallel.cp=2"
        "dp2-recompute-full 2 parallel.dp=2 parallel.recompute=full"
        "dp4 4 parallel.dp=4"
        "dp2-tp2-zero3 4 parallel.dp=2 parallel.tp=2 parallel.zero=3"
        "pp2-tp2-interleaved-sp 4 parallel.pp=2 parallel.tp=2 parallel.schedule=interleaved parallel.sequence_parallel=true"
        "dp2-pp2-zero1 4 parallel.dp=2 parallel.pp=2 parallel.zero=1"
        "cp2-tp2 4 parallel.cp=2 parallel.tp=2"
        "tp4 4 parallel.tp=4"
        "pp4-1f1b 4 parallel.pp=4 parallel.schedule=1f1b"
        "dp2-pp2-tp2-zero1 8 parallel.dp=2 parallel.pp=2 parallel.tp=2 parallel.zero=1"
        "dp2-cp2-tp2-zero2 8 parallel.dp=2 parallel.cp=2 parallel.tp=2 parallel.zero=2"
        "dp8-zero3 8 parallel.dp=8 parallel.zero=3 train.micro_batch=1"
    )
    for plan in "${plans[@]}"; do
        read -r name ranks settings <<< "$plan"
        [[ "$ranks" -gt "$ngpu" ]] && continue
        sets=()
        for s in $settings; do sets+=(--set "$s"); done
        parc_run "tiny-$name" correctness "$ranks" examples/tiny.par "${tiny[@]}" "${sets[@]}"
    done
fi

if has_phase bandwidth; then
    echo "== bandwidth"
    if [[ "$dry" == 1 || "$check_only" == 1 ]]; then
        echo "bandwidth: skipped (needs GPUs)"
    elif ! budget_allows bandwidth bandwidth "$ngpu"; then
        :
    elif [[ -x "$nccl_test" ]]; then
        started=$SECONDS
        timeout "$run_timeout" "$nccl_test" nccl_bus_bandwidth --ignored --nocapture \
            > "$out/bandwidth.txt" 2>&1
        code=$?
        echo "cuda_nccl nccl_bus_bandwidth: exit $code"
        [[ $code -ne 0 ]] && { tail -15 "$out/bandwidth.txt"; status=1; }
        log_run bandwidth bandwidth "$ngpu" "$code" "$((SECONDS - started))" test=1 $(budget_cut "$code")
    else
        echo "no test binary at $nccl_test (see correctness)"
        log_run bandwidth bandwidth "$ngpu" 127 0 test=1
        status=1
    fi
fi

# The rank counts 1, 2, 4, 8 up to NGPU.
counts=()
for n in 1 2 4 8; do [[ "$n" -le "$ngpu" ]] && counts+=("$n"); done

if has_phase scaling; then
    echo "== scaling"
    for model in 124m 350m; do
        spec_var="spec_$model"; batch_var="batch_$model"
        spec="${!spec_var}"; batch="${!batch_var}"
        shape_var="shape_$model[@]"; shape=("${!shape_var}")
        for n in "${counts[@]}"; do
            parc_run "scale-$model-dp$n" scaling "$n" "$spec" --set "parallel.dp=$n" \
                --set "train.global_batch=$((batch * n))" --set "train.micro_batch=$batch" \
                --set "train.steps=$steps" --set train.data=synthetic --set parallel.recompute=none \
                --set parallel.zero=0
        done
    done
fi

# XL runs: global batch = micro × microbatches (16 microbatches for pp; 4 for tp).
xl_common=("${xl_shape[@]}" --set train.data=synthetic --set parallel.zero=0 --set parallel.dp=1
           --set "train.micro_batch=$xl_micro" --set "train.steps=$steps")
shape=("${shape_xl[@]}")
if has_phase tp; then
    echo "== tp"
    for t in 1 2 4 8; do
        [[ "$t" -gt "$ngpu" ]] && continue
        [[ "$dry" == 1 && "$t" -gt 4 ]] && continue
        parc_run "xl-tp$t" tp "$t" "$spec_xl" "${xl_common[@]}" --set "parallel.tp=$t" \
            --set "train.global_batch=$((xl_micro * 4))"
    done
fi
if has_phase pp; then
    echo "== pp"
    for p in 2 4; do
        [[ "$p" -gt "$ngpu" ]] && continue
        for schedule in 1f1b interleaved; do
            run_flags=(--profile-step "$((steps - 1))")
            chunks=()
            shape=("${shape_xl[@]}")
            if [[ $schedule == interleaved ]]; then
                chunks=(--set parallel.virtual=2); shape+=(virtual=2)
            fi
            parc_run "xl-pp$p-$schedule" pp "$p" "$spec_xl" "${xl_common[@]}" --set "parallel.pp=$p" \
                --set "parallel.schedule=$schedule" "${chunks[@]}" \
                --set "train.global_batch=$((xl_micro * 16))"
            run_flags=()
        done
    done
fi

if has_phase zero; then
    echo "== zero"
    n="${counts[-1]}"; shape=("${shape_350m[@]}")
    # NCCL prints its channels and connections: what its buffers are made of (docs/memory.md).
    run_env=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT)
    for z in 0 1 2 3; do
        parc_run "zero$z-350m-dp$n" zero "$n" "$spec_350m" --set "parallel.dp=$n" --set "parallel.zero=$z" \
            --set "train.global_batch=$((batch_350m * n))" --set "train.micro_batch=$batch_350m" \
            --set "train.steps=$((steps < 4 ? steps : 4))" --set train.data=synthetic \
            --set parallel.recompute=none
    done
    run_env=()
fi

if [[ "$check_only" == 1 ]]; then
    echo "check only: $(grep -c '"invalid"' "$out/runs.jsonl") invalid plan(s)"
    exit "$status"
fi
"$python" bench/parity/multi_gpu_summary.py "$out" --tolerance "$tolerance" | tee "$out/summary.txt"
summary_status=${PIPESTATUS[0]}
[[ $summary_status -ne 0 ]] && status=1
exit "$status"
