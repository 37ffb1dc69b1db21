#!/usr/bin/env bash
# What a session with a lent GPU runs for issue #16, in two device calls of under ten minutes each
# (the lease is 30 minutes of device time, starts included). Logs and JSON land in $OUT (the device
# tool brings back at most 8 files, 16 MiB each, so each stage writes few).
#
#   bash bench/gpu_session.sh tests   # CUDA tests, gloo-on-CUDA probe, both example trainings   (~5 min)
#   bash bench/gpu_session.sh bench   # gpt1b at world 1 and in a fake world of 8 (traces), overhead (~8 min)
#
# Prepare once, here (the GPU machine has no optree and no internet):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl optree==0.20.0
# then call the device tool with carry [".whl"] and command `bash bench/gpu_session.sh tests`.
set -u -o pipefail
stage=${1:-tests}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import optree" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/optree-*.whl \
        || { echo "gpu_session.sh: no optree and no .whl/optree-*.whl to install (see the header)"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself, not an install
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    git log --oneline -1 2>/dev/null || true
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

case "$stage" in
tests)
    # 1. every CUDA test (tests/test_cuda.py runs tests/scripts/cuda_checks.py) and the core's
    timeout 330 python3 -m pytest -q -rs tests/test_cuda.py tests/test_core.py 2>&1 | tee "$OUT/tests.log" | tail -25
    # 2. which real collectives two ranks can run on one GPU (gloo on CUDA tensors)
    timeout 90 python3 bench/gpu_probe.py --json "$OUT/probe.json" 2>&1 | grep -v Warning | tail -12
    # 3. the example GPT trains on CUDA through both layers (the loss must fall as on CPU)
    timeout 90 python3 examples/train.py --device cuda --steps 150 --json "$OUT/train_functional.json" 2>&1 | tail -4
    timeout 120 python3 examples/train_compat.py --device cuda --steps 150 --mp --compare 2>&1 | tee "$OUT/train_compat.log" | tail -6
    ;;
bench)
    # 4. speed and memory against FSDP2 in the same run: world 1 (NCCL; each variant holds the whole
    #    model, gradients and AdamW state, ~16 GiB in fp32: three variants, `local` doubling as the loss
    #    reference, fit on one GPU where a fourth plus a separate reference might not), then rank 0 of a
    #    fake world of 8 (collectives are no-ops: streams, memory and per-unit overhead are real, compat
    #    included), with profiler traces of 2 steps
    timeout 270 python3 bench/step.py --model gpt1b --variants torch,functional,local --steps 8 --warmup 3 \
        --json "$OUT/gpt1b_w1.json" --check 2>&1 | tail -8
    timeout 270 python3 bench/step.py --model gpt1b --fake-world 8 --steps 8 --warmup 3 \
        --json "$OUT/gpt1b_fake8.json" --trace /tmp/traces 2>&1 | tail -8
    # 5. per-unit CPU overhead where the GPU is fast: 48 small blocks, fake world of 8
    timeout 120 python3 bench/step.py --model overhead --fake-world 8 --steps 20 --json "$OUT/overhead_fake8.json" 2>&1 | tail -7
    cp /tmp/traces/trace_functional_rank0.json.gz "$OUT/" 2>/dev/null || true
    cp /tmp/traces/trace_torch_rank0.json.gz "$OUT/" 2>/dev/null || true
    ;;
*)
    echo "gpu_session.sh: stage must be 'tests' or 'bench', got '$stage'"; exit 2 ;;
esac
