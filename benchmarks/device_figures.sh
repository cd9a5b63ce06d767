#!/usr/bin/env bash
# The figures a 16-core machine with one GPU can give, in at most 5 minutes.
#
# Run it from the repository root:
#
#     bash benchmarks/device_figures.sh                 # outputs into ./device-figures
#     OUT=/some/dir bash benchmarks/device_figures.sh
#     DEVICE_FIGURES_TINY=1 bash benchmarks/device_figures.sh   # the smallest settings: checks the script itself
#
# Steps, one after the other, each under `timeout`, its output in a log of
# its own under $OUT; a step that fails does not stop the next one:
#
#   install   only if roundel (from this tree, on PYTHONPATH) or what the steps need does not import:
#             pip install of those needs, leaving torch alone. Not `pip install -e ".[test]"`: that
#             pins torch to the CPU build this project tests with (replacing the machine's CUDA
#             build) and brings TensorFlow, Ray and Spark, minutes of downloads.
#   machine   cores, GPU, python and torch versions
#   scaling   python benchmarks/scaling.py --np 2,8,16: copy bandwidth, allreduce and training
#             against the rank count (scaling.json, scaling.png)
#   gpu       python benchmarks/torch_training.py --device cuda --np 1: ResNet-50 at 224x224,
#             batch 64, roundel against DDP over NCCL and one process without communication
#   cuda      python -m pytest -q tests/test_cuda.py
#   control   python benchmarks/control_scale.py --ranks 128,1024 --workers 12: rank 0 against simulated
#             ranks (through relays) with a core for each simulating process, if time is left
#
# Every step's time limit is cut to what is left of BUDGET_S (default 290 s).
# The summary at the end gives each step's exit status (124: timed out) and time.

set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-device-figures}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
BUDGET_S="${BUDGET_S:-290}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree's roundel, installed or not
START=$SECONDS
SUMMARY=()

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout (LIMIT_S, or less if less is left), log to $OUT/NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 15)); then
        SUMMARY+=("$(printf '%-8s not run: %d s left of %d' "$name" "$left" "$BUDGET_S")")
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (at most $limit s): $*"
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-8s exit %3d  %4d s  %s' "$name" "$status" $((SECONDS - began)) "$OUT/$name.log")")
}

if [[ -n "${DEVICE_FIGURES_TINY:-}" ]]; then
    SCALING=(--np 2 --sizes 4K,1M --quick --copy-mib 16 --timeout 60)
    GPU=(--model small_cnn --image-size 32 --batch-size 8 --warmup 1 --steps 2 --measurements 1)
    CONTROL=(--ranks 4,9 --workers 2 --steps 2 --relay-from-ranks 8 --per-host 2)
else
    SCALING=(--np 2,8,16 --sizes 1M,4M,16M,64M --models mlp --quick --timeout 60)
    GPU=(--model resnet50 --image-size 224 --batch-size 64 --warmup 3 --steps 5 --measurements 2)
    CONTROL=(--ranks 128,1024 --workers 12 --steps 10)
fi

if ! "$PYTHON" -c "import roundel, torch, numpy, cloudpickle, yaml, psutil, matplotlib, pytest" 2>/dev/null; then
    step install 100 "$PYTHON" -m pip install -q numpy cloudpickle pyyaml psutil matplotlib pytest pytest-timeout
fi
step machine 30 "$PYTHON" -c 'import os, sys, torch; print(len(os.sched_getaffinity(0)), "usable cores; python",
sys.version.split()[0], "; torch", torch.__version__, "; GPUs:",
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
step scaling 130 "$PYTHON" benchmarks/scaling.py "${SCALING[@]}" --json "$OUT/scaling.json" \
    --plot "$OUT/scaling.png"
step gpu 75 "$PYTHON" benchmarks/torch_training.py --device cuda --np 1 "${GPU[@]}" --rounds 1 \
    --only roundel,ddp,single --timeout 60 --json "$OUT/gpu_training.json" --plot "$OUT/gpu_training.png"
step cuda 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
step control 40 "$PYTHON" benchmarks/control_scale.py "${CONTROL[@]}" --json "$OUT/control_scale.json" \
    --plot "$OUT/control_scale.png"

echo
echo "=== summary ($((SECONDS - START)) s of $BUDGET_S; outputs in $OUT)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
