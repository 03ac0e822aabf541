#!/usr/bin/env bash
# What one CUDA GPU can check, in one run: the GPU suite, the GPU kernels benchmark and real Lightning fits of the BERT
# example on the GPU (1-bit Adam in one process, bf16-mixed; 1-bit Adam on two processes sharing the GPU over gloo;
# local steps, `onebit_diloco`, on two processes in 16-mixed; the sharded local steps, `onebit_diloco_fsdp`, 2 x 2 on
# four processes), each step under its own time limit, its output kept in $OUT (default results/tmp/gpu_check).
#
#     bash benchmarks/gpu_check.sh                       # on a machine with a CUDA GPU, from anywhere
#     ACCELERATOR=cpu PRECISION=32 MAX_STEPS=50 bash benchmarks/gpu_check.sh   # the fits only, on the CPU: tries
#                                                                              the script on a machine without a GPU
#
# It runs the checkout as it is (the repository root goes on PYTHONPATH), so it needs no `pip install` of the package:
# a GPU machine's own CUDA build of torch, lightning (with jsonargparse for LightningCLI), torchmetrics, pytest and,
# for the cupy kernels, cupy. The files it writes:
#
#   summary.txt             devices and versions, each step's exit status and seconds, the kernels benchmark's table
#   pytest.log, pytest_junit.xml   `python -m pytest -m gpu tests` (every test marked gpu; 2-GPU NCCL tests skip on one)
#   gpu_kernels.json        `python -m benchmarks.gpu_kernels`: compress / decompress against a device copy, with
#                           the device name
#   fit_one_gpu.log/.json   the example as configured (1-bit Adam, freeze_step="auto", 620 steps), bf16-mixed, one
#                           process on the GPU: through the warmup into the compression stage (--summary_json)
#   fit_two_processes.log/.json   the same with two processes on the one GPU (NCCL refuses two ranks on one device, so
#                           gloo, which moves the CUDA tensors through host memory): the flat compressed exchange,
#                           the replicas' bits compared every 10 steps (ReplicaCheck)
#   fit_diloco.log/.json    `bert_diloco.yaml` (local steps, a 1-bit outer step every 8 inner AdamW steps) on two
#                           processes on the GPU, each a replica, 16-mixed (the loss scaler on CUDA), SHORT_STEPS steps
#   fit_fsdp.log/.json      `bert_fsdp.yaml` (onebit_fsdp: 1-bit Adam across 2 replicas of 2 FSDP2 shards) on four
#                           processes on the GPU, bf16-mixed, SHORT_STEPS steps with a fixed warmup of half
#   fit_diloco_fsdp.log/.json   `bert_diloco_fsdp.yaml` (FSDP2 inside each replica) on four processes on the GPU,
#                           2 replicas x 2 shards, bf16-mixed, SHORT_STEPS steps
#
# The exit status is the number of steps that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/tmp/gpu_check}
ACCELERATOR=${ACCELERATOR:-gpu}
PYTHON=${PYTHON:-python3}
PRECISION=${PRECISION:-bf16-mixed}
MAX_STEPS=${MAX_STEPS:-}
SHORT_STEPS=${SHORT_STEPS:-160}  # the steps of the local-steps and FSDP2 fits
ONLY=${ONLY:-}  # a regular expression: only the steps whose name it matches (a rerun of what failed)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT ACCELERATOR PYTHON PRECISION MAX_STEPS SHORT_STEPS PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
failed=0

step() {  # step NAME LIMIT_S LOG COMMAND...: run COMMAND under a time limit, output to LOG, status to the summary
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    [[ -z $ONLY || $name =~ ^($ONLY)$ ]] || return 0
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    echo "step $name: exit $rc in $(($(date +%s) - start)) s (limit $limit s)$([ $rc = 124 ] && echo ': TIMED OUT')" \
        | tee -a "$SUMMARY"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

# the example on the accelerator with CONFIG (at most STEPS steps, validation at the half, and for 1-bit Adam
# (FIXED_FREEZE=1) a fixed warmup of half of them; STEPS empty: as configured) at PRECISION; the result in FIT. On
# this task a warmup shorter than about 120 steps leaves 1-bit Adam at chance (results/freeze_step_sweep.json): give
# MAX_STEPS >= 300 where the accuracy matters, not only that the compression stage runs
fit_args() {  # fit_args CONFIG PRECISION [STEPS [FIXED_FREEZE]]
    local steps=${3:-}
    FIT=(examples/bert_finetune.py fit --config "$1" --trainer.accelerator "$ACCELERATOR" --trainer.devices 1
        --trainer.precision "$2" --trainer.logger false --trainer.default_root_dir "$(mktemp -d)")
    if [ -n "$steps" ]; then
        FIT+=(--trainer.max_steps "$steps" --trainer.max_epochs -1 --trainer.val_check_interval $((steps / 2))
            --trainer.check_val_every_n_epoch null)
        if [ "${4:-0}" = 1 ]; then
            FIT+=(--optimizer.init_args.freeze_step $((steps / 2)) --optimizer.init_args.auto_freeze null)
        fi
    fi
}

# N processes on the one device: Lightning's environment from variables (each process a node of one device), gloo
if [ "${1:-}" = --processes ]; then
    count=$2 port=$((29500 + RANDOM % 1000)) pids=() rc=0
    shift 2
    for ((rank = 0; rank < count; rank++)); do
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$count NODE_RANK=$rank LOCAL_RANK=0 \
            "$PYTHON" "$@" --trainer.num_nodes "$count" --trainer.strategy.process_group_backend gloo \
            > >(sed -u "s/^/[rank $rank] /") 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    exit $rc
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    "$PYTHON" - <<'EOF'
import platform, torch, lightning
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| lightning", lightning.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as error:  # report, do not fail: the cupy kernels' tests skip without it
    print("cupy not importable:", error)
EOF
} >"$SUMMARY" 2>&1

if [ "$ACCELERATOR" = gpu ]; then
    step gpu_suite 320 "$OUT/pytest.log" "$PYTHON" -m pytest -m gpu tests -q -rs -p no:cacheprovider \
        --timeout 150 --junitxml="$OUT/pytest_junit.xml"
    step gpu_kernels 60 "$OUT/gpu_kernels.log" "$PYTHON" -m benchmarks.gpu_kernels --repeats 30
    [ -f "$OUT/gpu_kernels.log" ] && cat "$OUT/gpu_kernels.log" >>"$SUMMARY" && rm "$OUT/gpu_kernels.log"
    cp results/gpu_kernels.json "$OUT/" 2>/dev/null
fi

fit_args examples/configs/bert_onebit.yaml "$PRECISION" "$MAX_STEPS" 1
# ReplicaCheck compares the replicas' bits every 10 steps (two processes)
FIT+=(--trainer.callbacks+ lightning_onebit.ReplicaCheck --trainer.callbacks.every_n_steps 10)
step fit_one_gpu 120 "$OUT/fit_one_gpu.log" "$PYTHON" "${FIT[@]}" --summary_json "$OUT/fit_one_gpu.json"
step fit_two_processes 200 "$OUT/fit_two_processes.log" bash "$0" --processes 2 "${FIT[@]}" \
    --trainer.strategy lightning_onebit.OnebitStrategy --summary_json "$OUT/fit_two_processes.json"

# local steps: the loss scaler's 16-mixed where the accelerator has it (the CPU has bf16 only)
fit_args examples/configs/bert_diloco.yaml "$([ "$ACCELERATOR" = gpu ] && echo 16-mixed || echo "$PRECISION")" \
    "$SHORT_STEPS"
step fit_diloco 150 "$OUT/fit_diloco.log" bash "$0" --processes 2 "${FIT[@]}" --summary_json "$OUT/fit_diloco.json"
# FSDP2 inside each node (2 x 2 on four processes): onebit_fsdp (1-bit Adam), then the sharded local steps
fit_args examples/configs/bert_fsdp.yaml "$PRECISION" "$SHORT_STEPS" 1
step fit_fsdp 150 "$OUT/fit_fsdp.log" bash "$0" --processes 4 "${FIT[@]}" --summary_json "$OUT/fit_fsdp.json"
fit_args examples/configs/bert_diloco_fsdp.yaml "$PRECISION" "$SHORT_STEPS"
step fit_diloco_fsdp 150 "$OUT/fit_diloco_fsdp.log" bash "$0" --processes 4 "${FIT[@]}" \
    --summary_json "$OUT/fit_diloco_fsdp.json"

echo "steps failed: $failed" | tee -a "$SUMMARY"
exit "$failed"
