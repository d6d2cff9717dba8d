#!/usr/bin/env bash
# Prepare the wheels benchmarks/gpu_check.sh installs on a GPU machine that has no network.
#
#   benchmarks/prepare_gpu_wheels.sh [WHEELS_DIR]        # default: wheels/ (gitignored)
#
# Run it on a machine with PyPI access, from the repository root. The GPU machine (this
# workplace's nvidia-h200 kind) has Python 3.12 with torch, numpy, tqdm, ninja, psutil, msgpack,
# einops, py-cpuinfo, packaging, setuptools and wheel already, but no deepspeed. What goes into
# WHEELS_DIR (about 10 MB):
#   - deepspeed, at the version installed here (.venv), built from its source release (PyPI
#     ships no wheel) with DS_BUILD_OPS=0: a pure-Python wheel, its C++ ops (DeepSpeedCPUAdam)
#     are built just in time on the GPU machine, on first use;
#   - accelerate (tests/test_cuda.py checks what its prepare() does to the optimizer's state),
#     without its dependencies torch and numpy, with the others (huggingface-hub, safetensors,
#     pyyaml and theirs);
#   - deepspeed's dependencies that torch images usually lack (hjson, pydantic with its
#     compiled core for that Python, annotated-types, typing-inspection, typing-extensions)
#     and, as a fallback, the small ones that are usually there (einops, msgpack, ninja,
#     packaging, psutil, py-cpuinfo, tqdm), plus setuptools and wheel for the build of zenflow
#     itself without build isolation. Not numpy or torch: the GPU machine's own are used.
# gpu_check.sh installs with `pip install --no-index --find-links WHEELS_DIR`, which takes
# from the folder only what the machine is missing, so an extra wheel here is harmless.
#
# Bring the folder along with the working tree: the device tool's `carry: ["wheels"]` (the
# folder is ignored by git, so it travels only when carried; it counts towards the 64 MiB limit).
#
# Environment: PYTHON (the interpreter whose pip is used; default .venv/bin/python, else
# python3), GPU_PYTHON_VERSION (default 3.12), DEEPSPEED_VERSION (default: the installed one,
# else 0.19.8), GPU_PLATFORMS (manylinux tags for binary wheels, x86-64).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${1:-wheels}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PYVER=${GPU_PYTHON_VERSION:-3.12}
PLATFORMS=${GPU_PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"}

installed_version() { # the version of $1 in $PYTHON's environment, or nothing
    "$PYTHON" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

pinned() { # "name==version" as installed here, else "name" (the newest on PyPI)
    local version
    version=$(installed_version "$1")
    if [[ -n "$version" ]]; then echo "$1==$version"; else echo "$1"; fi
}

DS_VERSION=${DEEPSPEED_VERSION:-$(installed_version deepspeed)}
DS_VERSION=${DS_VERSION:-0.19.8}
mkdir -p "$DEST"
echo "== wheels for Python $PYVER (x86-64) into $DEST/, deepspeed $DS_VERSION"

# 1. deepspeed: source release -> a py3-none-any wheel without prebuilt ops.
rm -f "$DEST"/deepspeed-*.whl
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps "deepspeed==$DS_VERSION" -w "$DEST"

# 2. Its dependencies (and setuptools/wheel for zenflow's build), binary for the GPU machine's
# Python. pip resolves their own dependencies for that target; numpy and torch are left out.
platform_args=()
for tag in $PLATFORMS; do platform_args+=(--platform "$tag"); done
names=()
for name in hjson pydantic annotated-types typing-inspection typing-extensions einops msgpack \
    ninja packaging psutil py-cpuinfo tqdm setuptools wheel; do
    names+=("$(pinned "$name")")
done
for name in huggingface-hub safetensors pyyaml; do
    names+=("$(pinned "$name")")
done
"$PYTHON" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platform_args[@]}" -d "$DEST" "${names[@]}"
rm -f "$DEST"/accelerate-*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "$(pinned accelerate)"

# One version of each project, and none of numpy or torch.
declare -A seen=()
for wheel in "$DEST"/*.whl; do
    project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
    case $project in
    numpy | torch | nvidia_*)
        echo "error: $wheel: the GPU machine has its own $project; delete it" >&2
        exit 1
        ;;
    esac
    if [[ -n "${seen[$project]:-}" ]]; then
        echo "error: two versions of $project in $DEST: ${seen[$project]} and $wheel" >&2
        exit 1
    fi
    seen[$project]=$wheel
done
ls -l "$DEST"
du -sh "$DEST"
