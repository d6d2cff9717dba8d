#!/usr/bin/env bash
# shellcheck disable=SC2317  # the stage functions run through `bash -c NAME` (export -f)
# The GPU check: install zenflow on a GPU machine without network, run the CUDA tests, then time
# a GPT-355M training step (zenflow vs DeepSpeed ZeRO-Offload vs AdamW without offload).
#
#   benchmarks/gpu_check.sh RESULTS_DIR [WHEELS_DIR]      # from anywhere; WHEELS_DIR: wheels/
#
# Needs: python3 with a CUDA build of torch (GPU_CHECK_PYTHON or PYTHON to use another), and the
# wheels that benchmarks/prepare_gpu_wheels.sh prepares on a networked machine (deepspeed and the
# dependencies the GPU machine lacks). Without WHEELS_DIR zenflow is still installed (without
# deepspeed: its row then reports the import error) and everything else runs.
#
# On this workplace's device tool (nvidia-h200), with wheels/ prepared here first:
#   run(command="GPU_CHECK_TAR=$OUT/gpu_check.tgz bash benchmarks/gpu_check.sh /tmp/gpu_check;
#                cp /tmp/gpu_check/summary.md /tmp/gpu_check/bench.md $OUT/",
#       carry=["wheels"], timeout_s=520)
#
# Stages (each under `timeout`, limited to what is left of the budget, 480 s by default, so the
# whole script ends within 8 minutes; a stage that fails or times out does not stop the next):
#   env        10 s  nvidia-smi, python, torch/CUDA versions, installed packages, disk
#   install    90 s  pip install --no-index --find-links WHEELS_DIR --no-build-isolation -e .
#                    (builds csrc/ into zenflow/_cpu_adam*.so); then, in the background, the
#                    just-in-time build of DeepSpeed's CPU Adam, so that its row does not pay it
#   tests      75 s  python -m pytest -m cuda tests/test_cuda.py
#   hand-over  30 s  bench_compile_overhead.py --hand-over-only --device cuda (host time the
#                    backward's hand-over ops add per weight, through the copy stream)
#   zenflow   200 s  bench_gpu_step.py --peers zenflow     (Inductor compile + 8 + 16 + 8 steps;
#                    on an H200 the first step, compiles included, took 122 s)
#   ds-offload 90 s  bench_gpu_step.py --peers ds-offload  (3 + 16 + 4 steps)
#   ds-zenflow 90 s  bench_gpu_step.py --peers ds-zenflow  (DeepSpeed's ZenFlow, 8 + 16 + 4 steps)
#   adamw      60 s  bench_gpu_step.py --peers adamw
#   zenflow-devsum 100 s zenflow with accumulate_on_device, only if 60 s or more are left (its
#                    compiles mostly hit the Inductor cache the zenflow row filled)
#   summary   (reserved 10 s) the table of every row that finished, RESULTS_DIR/bench.md
# Results, written stage by stage so that a run cut short still reports: RESULTS_DIR/summary.md
# (one line per stage: result and seconds), <stage>.log, tests.xml, bench_<row>.json, bench.md.
# GPU_CHECK_TAR=FILE also packs RESULTS_DIR into FILE after every stage (the device tool brings
# back at most 8 files). GPU_CHECK_BUDGET_S changes the budget.
set -uo pipefail

RES=${1:?usage: benchmarks/gpu_check.sh RESULTS_DIR [WHEELS_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${2:-$ROOT/wheels}
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
RESERVE=10 # kept for the summary
TAR=${GPU_CHECK_TAR:-}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")
cd "$ROOT" || exit 1
# DeepSpeed's just-in-time builds go under RESULTS_DIR: the background build is stopped if it
# is still running at the end, and a build killed midway leaves a lock that would hang every
# later build sharing its folder (the user's default one, otherwise).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$RES/torch_extensions}
export PYTHON WHEELS RES PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
START=$SECONDS
FAILED=0
BACKGROUND=()

printf '# gpu_check %s\n\n| stage | result | seconds |\n|---|---|---|\n' "$(date -u +%FT%TZ)" \
    >"$RES/summary.md"

pack() {
    if [[ -n "$TAR" ]]; then
        tar czf "$TAR.tmp" --exclude=torch_extensions -C "$(dirname "$RES")" "$(basename "$RES")" &&
            mv "$TAR.tmp" "$TAR"
    fi
}

# stage NAME WANT_S FUNCTION: runs FUNCTION in a child bash under timeout, for WANT_S seconds or
# what is left of the budget, output in RES/NAME.log; one line in summary.md.
stage() {
    local name=$1 want=$2 fn=$3
    local left=$((BUDGET - RESERVE - (SECONDS - START)))
    local limit=$((want < left ? want : left))
    if ((limit < (want < 15 ? want : 15))); then
        echo "| $name | skipped: ${left}s of the budget left | 0 |" >>"$RES/summary.md"
        echo "== $name: skipped, ${left}s of the budget left"
        FAILED=1
        return
    fi
    echo "== [$((SECONDS - START))s] $name (limit ${limit}s, log $RES/$name.log)"
    local began=$SECONDS rc result
    timeout -k 5 "$limit" bash -c "$fn" >"$RES/$name.log" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then
        result="timed out at ${limit}s"
    elif ((rc != 0)); then
        result="failed (exit $rc)"
    else
        result=ok
    fi
    ((rc == 0)) || FAILED=1
    echo "| $name | $result | $((SECONDS - began)) |" >>"$RES/summary.md"
    tail -n 12 "$RES/$name.log"
    echo "== $name: $result in $((SECONDS - began))s (elapsed $((SECONDS - START))s)"
    pack
}

env_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    "$PYTHON" -c 'import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")'
    "$PYTHON" -m pip list 2>/dev/null | grep -Ei '^(torch|triton|deepspeed|pydantic|hjson|setuptools|numpy|pytest|ninja) '
    echo "cores $(nproc)"
    free -g | head -2
    df -h . /tmp | tail -2
    command -v g++ c++ nvcc ninja
    ls "$WHEELS" 2>/dev/null || echo "no wheels folder at $WHEELS"
}

install() {
    set -e
    local links=(--no-index)
    [[ -d "$WHEELS" ]] && links+=(--find-links "$WHEELS")
    # --no-build-isolation builds with the machine's setuptools: make sure it is new enough.
    "$PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 69)' ||
        "$PYTHON" -m pip install "${links[@]}" "setuptools>=69" wheel
    if ! "$PYTHON" -m pip install "${links[@]}" --no-build-isolation -e .; then
        echo "!! zenflow with its dependencies did not install; again without them (no deepspeed)"
        "$PYTHON" -m pip install --no-index --no-build-isolation --no-deps -e .
    fi
    "$PYTHON" -c 'import torch, zenflow
p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)
zenflow.CPUAdamW([p], lr=0.1).step()
assert p.detach().lt(1).all(), p
from zenflow.runtime import cpu_adam
print("zenflow CPU AdamW ok, isa", cpu_adam.isa())'
    "$PYTHON" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
    # For one CUDA test (Accelerate's prepare); its absence fails that test, not the check.
    "$PYTHON" -m pip install "${links[@]}" accelerate ||
        echo "!! accelerate did not install: test_accelerate_prepare_leaves_the_host_state_on_the_host will fail"
}

# DeepSpeedCPUAdam is compiled on first use (ninja, ~1 min): start it now, next to the tests.
ds_cpu_adam_build() {
    "$PYTHON" -c 'import time; t = time.time()
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load()
print(f"DeepSpeedCPUAdam built in {time.time() - t:.0f}s")'
}

tests() {
    "$PYTHON" -m pytest -v -m cuda tests/test_cuda.py -p no:cacheprovider --tb=short \
        --durations=8 --junitxml "$RES/tests.xml" -o junit_family=xunit2
}

hand_over() {
    "$PYTHON" benchmarks/bench_compile_overhead.py --hand-over-only --device cuda
}

bench() { # bench ROW [OPTIONS...]
    local row=$1
    shift
    "$PYTHON" benchmarks/bench_gpu_step.py --device cuda --out "$RES" --peers "$row" "$@"
}

export -f env_info install ds_cpu_adam_build tests hand_over bench

stage env 10 env_info
stage install 90 install
if grep -q "^deepspeed " "$RES/install.log"; then
    timeout -k 5 200 bash -c ds_cpu_adam_build >"$RES/ds_cpu_adam_build.log" 2>&1 &
    BACKGROUND+=($!)
fi
stage tests 75 tests
stage hand-over 30 hand_over
stage zenflow 200 "bench zenflow"
ds_options=""
build_log=$RES/ds_cpu_adam_build.log
if [[ -f "$build_log" ]] && grep -q Error "$build_log" && ! grep -q "built in" "$build_log"; then
    ds_options="--ds-torch-adam"
    echo "| note | DeepSpeedCPUAdam did not build (ds_cpu_adam_build.log): the DeepSpeed row uses torch's Adam on the CPU | - |" \
        >>"$RES/summary.md"
fi
stage ds-offload 90 "bench ds-offload $ds_options" # waits for the background build if still running
stage ds-zenflow 90 "bench ds-zenflow $ds_options"
stage adamw 60 "bench adamw"
if (((BUDGET - RESERVE) - (SECONDS - START) >= 60)); then # only with time to spare
    stage zenflow-devsum 100 "bench zenflow-devsum"
fi

for pid in "${BACKGROUND[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        built="still building at the end: stopped"
    else
        built=$(grep -E 'built in|Error' "$RES/ds_cpu_adam_build.log" | tail -n 1)
    fi
    echo "| ds_cpu_adam_build (background) | ${built:-see ds_cpu_adam_build.log} | - |" \
        >>"$RES/summary.md"
done
"$PYTHON" benchmarks/bench_gpu_step.py --summarize --out "$RES" >/dev/null 2>&1
echo "| total | $([[ $FAILED == 0 ]] && echo ok || echo 'see above') | $((SECONDS - START)) |" \
    >>"$RES/summary.md"
pack
echo
cat "$RES/summary.md"
echo
[[ -f "$RES/bench.md" ]] && cat "$RES/bench.md"
exit "$FAILED"
