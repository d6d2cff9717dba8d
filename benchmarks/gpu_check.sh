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
# On this workplace's device tool (nvidia-h200), with wheels/ prepared here first, two calls right
# after each other (each at most 5 minutes, install included; the second finds the first's
# install when the machine is still warm, and installs again otherwise):
#   run(command="GPU_CHECK_TAR=$OUT/gpu_check.tgz bash benchmarks/gpu_check.sh /tmp/gpu_check",
#       carry=["wheels"], timeout_s=300)
#   run(command="GPU_CHECK_STAGES=second GPU_CHECK_TAR=$OUT/gpu_check.tgz \
#                bash benchmarks/gpu_check.sh /tmp/gpu_check", carry=["wheels"], timeout_s=300)
#
# GPU_CHECK_STAGES picks the stages, comma-separated (they run in the order below), or one of
# the two calls: "first" (the default: env,install,tests,zenflow,ds-offload) and "second"
# (install,contention,adamw,zenflow-hostsum,ds-zenflow). Each stage runs under `timeout`,
# limited to what is left of the budget (GPU_CHECK_BUDGET_S, 290 s by default); a stage that
# fails or times out does not stop the next. The limits, and the split into calls, follow what
# each stage took on an H200 on 2026-12-04 (in brackets; the zenflow rows' first step is
# Inductor compiling the model):
#   env        25 s  [11 s] nvidia-smi, python, torch/CUDA versions, installed packages, disk,
#                    /dev/shm, `ulimit -l` (pinned memory), the host's memory bandwidth (one 1 GiB
#                    copy)
#   install    90 s  [44 s] pip install --no-index --find-links WHEELS_DIR --no-build-isolation
#                    -e . (builds csrc/ into zenflow/_cpu_adam*.so; skipped when this tree's zenflow
#                    and deepspeed already import); then, in the background, the just-in-time
#                    build of DeepSpeed's CPU Adam [51 s] (a stale lock of a killed build removed
#                    first), in every call that has a DeepSpeed row (a warm machine has it built)
#   tests      75 s  [44 s] python -m pytest -m cuda tests/test_cuda.py (beside DeepSpeed's build)
#   (the DeepSpeed build is waited for here, up to 120 s: nothing is timed while it compiles;
#    a build whose log has no "built in" line failed, and the DeepSpeed rows then use torch's
#    Adam on the CPU, labelled)
#   contention 45 s  (not yet run on a GPU) bench_contention.py --device cuda --reserved
#                    0.5,0.875: the training thread's host time per kernel launch and per Python
#                    loop step with the CPU pool idle, and running AdamW passes pinned as
#                    bind_cores pins it and unpinned, at the default share of the cores and with
#                    two threads (after DeepSpeed's build, which would take the cores)
#   zenflow   130 s  [115 s: 67 set-up and compile, 6 timed, 42 profiling] bench_gpu_step.py
#                    --peers zenflow: accumulate_on_device "auto" (device-side sums on one
#                    GPU); Inductor compiles the model, the device step runs eagerly;
#                    topk 0.1, update_interval 8, select_interval 64, overlap: 16 warm-up steps,
#                    a whole select cycle timed and another profiled, then two steps traced
#                    (trace_zenflow.json.gz)
#   ds-offload 60 s  [36 s] bench_gpu_step.py --peers ds-offload  (3 + 16 + 4 steps)
#   adamw      90 s  [65 s] bench_gpu_step.py --peers adamw
#   zenflow-hostsum 120 s  [94 s, Inductor's cache warm] zenflow with accumulate_on_device false
#                    (window sums on the host)
#   ds-zenflow 80 s  [54 s] bench_gpu_step.py --peers ds-zenflow (DeepSpeed's ZenFlow at
#                    zenflow's schedule, a select cycle timed; last: its worker can hang for
#                    minutes)
#   hand-over  30 s  (only when named) bench_compile_overhead.py --hand-over-only --device cuda
#   summary   (reserved 10 s) the table of every row that finished, RESULTS_DIR/bench.md
# Results, written stage by stage so that a run cut short still reports: RESULTS_DIR/summary.md
# (one line per stage: result and seconds), <stage>.log, tests.xml, bench_<row>.json, bench.md.
# GPU_CHECK_LIMIT_<stage> (dashes as underscores: GPU_CHECK_LIMIT_zenflow_hostsum=100) replaces a
# stage's limit, for a call whose budget allows more than the defaults above.
# GPU_CHECK_BENCH_OPTIONS adds options to every bench_gpu_step.py row, for a rerun within the same
# lease (e.g. GPU_CHECK_STAGES=zenflow GPU_CHECK_BENCH_OPTIONS="--profile-steps 16").
# GPU_CHECK_TAR=FILE also packs RESULTS_DIR into FILE after every stage (the device tool brings
# back at most 8 files).
set -uo pipefail

RES=${1:?usage: benchmarks/gpu_check.sh RESULTS_DIR [WHEELS_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${2:-$ROOT/wheels}
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
BUDGET=${GPU_CHECK_BUDGET_S:-290}
STAGES=${GPU_CHECK_STAGES:-first}
case $STAGES in
first) STAGES=env,install,tests,zenflow,ds-offload ;;
second) STAGES=install,contention,adamw,zenflow-hostsum,ds-zenflow ;;
esac
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

printf '# gpu_check %s, stages %s\n\n| stage | result | seconds |\n|---|---|---|\n' \
    "$(date -u +%FT%TZ)" "$STAGES" >>"$RES/summary.md"

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
    [[ ",$STAGES," == *",$name,"* ]] || return 0
    local override="GPU_CHECK_LIMIT_${name//-/_}"
    want=${!override:-$want}
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
    if command -v lscpu >/dev/null; then # hyperthreads share a core with the CPU pool's workers
        lscpu | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)):'
    fi
    free -g | head -2
    df -h . /tmp /dev/shm | tail -3
    echo "ulimit -l (pinned memory): $(ulimit -l)"
    "$PYTHON" -c 'import time, torch
src, dst = torch.empty(2**28), torch.empty(2**28)
dst.copy_(src)
t = time.perf_counter(); dst.copy_(src); s = time.perf_counter() - t
print(f"host memory bandwidth: {2 * src.nbytes / s / 1e9:.1f} GB/s (1 GiB copied, {torch.get_num_threads()} threads)")'
    command -v g++ c++ nvcc ninja
    ls "$WHEELS" 2>/dev/null || echo "no wheels folder at $WHEELS"
}

install() {
    set -e
    if "$PYTHON" -c 'import deepspeed, zenflow, zenflow.runtime.cpu_adam as c, sys
c._load(); sys.exit(not zenflow.__file__.startswith(sys.argv[1]))' "$ROOT"; then
        echo "zenflow (from this tree) and deepspeed already import: nothing to install"
        "$PYTHON" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
        return 0
    fi
    local links=(--no-index)
    [[ -d "$WHEELS" ]] && links+=(--find-links "$WHEELS")
    # --no-build-isolation builds with the machine's setuptools: make sure it is new enough.
    "$PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' ||
        "$PYTHON" -m pip install "${links[@]}" "setuptools>=77" wheel
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
    # The machine as zenflow sees it (GPUs, CPUs, where the pool runs): read, not required.
    "$PYTHON" -m zenflow || echo "!! python -m zenflow exited with $?"
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

contention() {
    "$PYTHON" benchmarks/bench_contention.py --device cuda --reserved 0.5,0.875
}

bench() { # bench ROW [OPTIONS...]
    local row=$1
    shift
    # shellcheck disable=SC2086  # the options are words to split
    "$PYTHON" benchmarks/bench_gpu_step.py --device cuda --out "$RES" --peers "$row" "$@" \
        ${GPU_CHECK_BENCH_OPTIONS:-}
}

export -f env_info install ds_cpu_adam_build tests hand_over contention bench

stage env 25 env_info
stage install 90 install
build_log=$RES/ds_cpu_adam_build.log
if [[ ",$STAGES," == *,ds-* ]] && "$PYTHON" -c 'import deepspeed' 2>/dev/null; then
    # A build killed midway leaves a lock that hangs every later one: none runs now.
    find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null
    timeout -k 5 200 bash -c ds_cpu_adam_build >"$build_log" 2>&1 &
    BACKGROUND+=($!)
fi
stage tests 75 tests
stage hand-over 30 hand_over
for pid in "${BACKGROUND[@]}"; do # nothing is timed while DeepSpeed's build takes the cores
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
done
ds_options=""
if [[ ${#BACKGROUND[@]} -gt 0 ]] && ! grep -q "built in" "$build_log"; then
    ds_options="--ds-torch-adam"
    echo "| note | DeepSpeedCPUAdam did not build (ds_cpu_adam_build.log): the DeepSpeed rows use torch's Adam on the CPU | - |" \
        >>"$RES/summary.md"
fi
stage contention 45 contention
stage zenflow 130 "bench zenflow"
stage ds-offload 60 "bench ds-offload $ds_options"
stage adamw 90 "bench adamw"
stage zenflow-hostsum 120 "bench zenflow-hostsum"
stage ds-zenflow 80 "bench ds-zenflow $ds_options"

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
