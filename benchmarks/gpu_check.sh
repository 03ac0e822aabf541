#!/usr/bin/env bash
# What one CUDA GPU can check, in one run: the GPU suite, the GPU kernels benchmark and two real Lightning fits of the
# BERT example (one process on the GPU, bf16-mixed; two processes sharing the GPU over gloo), each step under its own
# time limit, its output kept in $OUT (default results/tmp/gpu_check).
#
#     bash benchmarks/gpu_check.sh                       # on a machine with a CUDA GPU, from anywhere
#     ACCELERATOR=cpu PRECISION=32 MAX_STEPS=50 bash benchmarks/gpu_check.sh   # the two fits only, on the CPU: tries
#                                                                              the script on a machine without a GPU
#
# It runs the checkout as it is (the repository root goes on PYTHONPATH), so it needs no `pip install` of the package:
# a GPU machine's own CUDA build of torch, lightning (with jsonargparse for LightningCLI), torchmetrics, pytest and,
# for the cupy kernels, cupy. The files it writes (eight, so that they fit a small transfer):
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
#
# The exit status is the number of steps that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/tmp/gpu_check}
ACCELERATOR=${ACCELERATOR:-gpu}
PYTHON=${PYTHON:-python3}
PRECISION=${PRECISION:-bf16-mixed}
MAX_STEPS=${MAX_STEPS:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT ACCELERATOR PYTHON PRECISION MAX_STEPS PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
failed=0

step() {  # step NAME LIMIT_S LOG COMMAND...: run COMMAND under a time limit, output to LOG, status to the summary
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    echo "step $name: exit $rc in $(($(date +%s) - start)) s (limit $limit s)$([ $rc = 124 ] && echo ': TIMED OUT')" \
        | tee -a "$SUMMARY"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

# the example on the accelerator as its config has it (620 steps, freeze_step="auto"), ReplicaCheck comparing the
# replicas' bits every 10 steps (two processes); with MAX_STEPS, that many steps and a fixed warmup of a third of them
FIT_ARGS=(examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml
    --trainer.accelerator "$ACCELERATOR" --trainer.devices 1 --trainer.precision "$PRECISION"
    --trainer.logger false --trainer.default_root_dir "$(mktemp -d)"
    --trainer.callbacks+ lightning_onebit.ReplicaCheck --trainer.callbacks.every_n_steps 10)
if [ -n "$MAX_STEPS" ]; then
    FIT_ARGS+=(--trainer.max_steps "$MAX_STEPS" --trainer.max_epochs -1 --trainer.val_check_interval $((MAX_STEPS / 2))
        --trainer.check_val_every_n_epoch null
        --optimizer.init_args.freeze_step $((MAX_STEPS / 3)) --optimizer.init_args.auto_freeze null)
fi

# two processes, one GPU: Lightning's environment from variables (each process a node of one device), gloo
if [ "${1:-}" = --two-processes ]; then
    port=$((29500 + RANDOM % 1000)) pids=() rc=0
    for rank in 0 1; do
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 NODE_RANK=$rank LOCAL_RANK=0 \
            "$PYTHON" "${FIT_ARGS[@]}" --trainer.num_nodes 2 --trainer.strategy lightning_onebit.OnebitStrategy \
            --trainer.strategy.process_group_backend gloo --summary_json "$OUT/fit_two_processes.json" \
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
    step gpu_suite 200 "$OUT/pytest.log" "$PYTHON" -m pytest -m gpu tests -q -rs -p no:cacheprovider \
        --timeout 150 --junitxml="$OUT/pytest_junit.xml"
    step gpu_kernels 60 "$OUT/gpu_kernels.log" "$PYTHON" -m benchmarks.gpu_kernels --repeats 30
    cat "$OUT/gpu_kernels.log" >>"$SUMMARY" && rm "$OUT/gpu_kernels.log"
    cp results/gpu_kernels.json "$OUT/" 2>/dev/null
fi

step fit_one_gpu 120 "$OUT/fit_one_gpu.log" "$PYTHON" "${FIT_ARGS[@]}" --summary_json "$OUT/fit_one_gpu.json"

step fit_two_processes 200 "$OUT/fit_two_processes.log" bash "$0" --two-processes

echo "steps failed: $failed" | tee -a "$SUMMARY"
exit "$failed"
