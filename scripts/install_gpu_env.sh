#!/usr/bin/env bash
# Build the GPU environment of docs/gpu.md in its own virtual environment (default .venv-gpu; .venv stays the CPU
# environment of `make setup`).
#
#   scripts/install_gpu_env.sh --backend fsdp|megatron [--venv DIR] [--python PY] [--skip-flash-attn]
#
# pip installs what has wheels (torch, vLLM, verl, megatron-core, mbridge and this package with the extra of the
# backend); the rest is built from source against the installed torch, which needs network access, nvcc of the CUDA
# major version torch was built for (13) and a C++ compiler: flash-attn for both backends, and for megatron
# Transformer Engine's torch extension, NVIDIA Apex and DeepEP (DeepEP also needs the libibverbs headers, e.g. the
# Debian/Ubuntu package libibverbs-dev). It ends with one line per package (import and version) and the CUDA check.
#
# Never run on a GPU machine so far (docs/gpu.md, "What was never run on a GPU").
set -euo pipefail

# The stack (docs/gpu.md, "The stack"; tests/test_gpu_env.py keeps these equal to the doc's table and to pyproject).
PYTHON_VERSION=3.12
TORCH_VERSION=2.11.0
VLLM_VERSION=0.24.0
VERL_VERSION=0.9.1
MEGATRON_CORE_VERSION=0.16.1
MBRIDGE_VERSION=0.15.1
FLASH_ATTN_VERSION=2.8.3
TRANSFORMER_ENGINE_VERSION=2.14.0
APEX_REPO=https://github.com/NVIDIA/apex.git
APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
DEEPEP_REPO=https://github.com/deepseek-ai/DeepEP.git
DEEPEP_VERSION=1.2.1
DEEPEP_COMMIT=9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee  # tag v1.2.1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
Usage: scripts/install_gpu_env.sh --backend fsdp|megatron [--venv DIR] [--python PY] [--skip-flash-attn]

Create a Python ${PYTHON_VERSION} virtual environment with the GPU stack of docs/gpu.md.

  --backend fsdp       torch ${TORCH_VERSION}, vLLM ${VLLM_VERSION}, verl ${VERL_VERSION}, respo-verl[gpu],
                       flash-attn ${FLASH_ATTN_VERSION}
  --backend megatron   the above plus respo-verl[gpu-megatron] (megatron-core ${MEGATRON_CORE_VERSION},
                       mbridge ${MBRIDGE_VERSION}), Transformer Engine ${TRANSFORMER_ENGINE_VERSION},
                       NVIDIA Apex (${APEX_COMMIT:0:8}), DeepEP ${DEEPEP_VERSION}
  --venv DIR           where to create it (default: .venv-gpu; .venv is the CPU environment of make setup)
  --python PY          the interpreter to create it with (default: python${PYTHON_VERSION}); must be Python ${PYTHON_VERSION}
  --skip-flash-attn    do not build flash-attn (then run with
                       actor_rollout_ref.model.override_config.attn_implementation=sdpa)
  -h, --help           print this help

Environment: MAX_JOBS (parallel compile jobs, default 8), TORCH_CUDA_ARCH_LIST (default 9.0, H100/H200),
NVSHMEM_DIR (DeepEP; default: an importable nvidia.nvshmem), BUILD_DIR (source checkouts,
default: DIR/src).
EOF
}

die() {
    echo "install_gpu_env.sh: $*" >&2
    exit 1
}

BACKEND=""
VENV=".venv-gpu"
PYTHON="python${PYTHON_VERSION}"
SKIP_FLASH_ATTN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --backend)
            [[ $# -ge 2 ]] || { echo "install_gpu_env.sh: --backend needs a value (fsdp or megatron)" >&2; exit 2; }
            BACKEND="$2"
            shift 2
            ;;
        --backend=*)
            BACKEND="${1#*=}"
            shift
            ;;
        --venv)
            [[ $# -ge 2 ]] || { echo "install_gpu_env.sh: --venv needs a directory" >&2; exit 2; }
            VENV="$2"
            shift 2
            ;;
        --venv=*)
            VENV="${1#*=}"
            shift
            ;;
        --python)
            [[ $# -ge 2 ]] || { echo "install_gpu_env.sh: --python needs an interpreter" >&2; exit 2; }
            PYTHON="$2"
            shift 2
            ;;
        --python=*)
            PYTHON="${1#*=}"
            shift
            ;;
        --skip-flash-attn)
            SKIP_FLASH_ATTN=1
            shift
            ;;
        *)
            echo "install_gpu_env.sh: unknown argument '$1' (see --help)" >&2
            exit 2
            ;;
    esac
done

case "$BACKEND" in
    fsdp) EXTRA=gpu ;;
    megatron) EXTRA=gpu-megatron ;;
    "")
        echo "install_gpu_env.sh: --backend is required (fsdp or megatron); see --help" >&2
        exit 2
        ;;
    *)
        echo "install_gpu_env.sh: unknown backend '$BACKEND' (expected fsdp or megatron)" >&2
        exit 2
        ;;
esac

# Resolve the venv path against the repository root, and refuse the CPU environment.
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
if [[ "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/$(basename "$VENV")" == "$ROOT/.venv" ]]; then
    die ".venv is the CPU environment of make setup; choose another --venv (default .venv-gpu)"
fi

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found; Python ${PYTHON_VERSION} is required (--python PY)"
PY_FOUND="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$PY_FOUND" == "$PYTHON_VERSION" ]] ||
    die "Python ${PYTHON_VERSION} is required (the stack of docs/gpu.md), but $PYTHON is Python $PY_FOUND"

export MAX_JOBS="${MAX_JOBS:-8}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
BUILD_DIR="${BUILD_DIR:-$VENV/src}"

# Source builds need nvcc of torch's CUDA major version (Apex refuses a mismatch; flash-attn and TE link against it).
if [[ "$BACKEND" == megatron || "$SKIP_FLASH_ATTN" == 0 ]]; then
    command -v nvcc >/dev/null 2>&1 ||
        die "nvcc not found: flash-attn$([[ $BACKEND == megatron ]] && echo ", Transformer Engine, Apex and DeepEP") are built from source (or pass --skip-flash-attn for fsdp)"
    NVCC_MAJOR="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
    [[ "$NVCC_MAJOR" == 13 ]] || die "nvcc is CUDA ${NVCC_MAJOR:-?}, but torch ${TORCH_VERSION} from PyPI is built for CUDA 13"
fi
if [[ "$BACKEND" == megatron ]]; then
    command -v git >/dev/null 2>&1 || die "git not found (Apex and DeepEP are cloned from GitHub)"
    [[ -e /usr/include/infiniband/verbs.h ]] ||
        echo "install_gpu_env.sh: warning: /usr/include/infiniband/verbs.h not found; DeepEP's build needs the libibverbs headers" >&2
fi

echo "== venv $VENV (Python $PY_FOUND, backend $BACKEND)"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip setuptools wheel packaging ninja

echo "== torch ${TORCH_VERSION} (PyPI's build for CUDA 13.0)"
"${PIP[@]}" install "torch==${TORCH_VERSION}"

echo "== respo-verl[${EXTRA}] (verl ${VERL_VERSION}, vLLM ${VLLM_VERSION}$([[ $BACKEND == megatron ]] && echo ", megatron-core ${MEGATRON_CORE_VERSION}, mbridge ${MBRIDGE_VERSION}"))"
"${PIP[@]}" install -e "${ROOT}[${EXTRA}]" "torch==${TORCH_VERSION}"

if [[ "$SKIP_FLASH_ATTN" == 0 ]]; then
    echo "== flash-attn ${FLASH_ATTN_VERSION} (from its sdist, against torch ${TORCH_VERSION}; MAX_JOBS=${MAX_JOBS})"
    # Built here, never fetched: flash-attn's setup.py otherwise downloads a prebuilt wheel from its GitHub releases,
    # with no checksum, whenever one matches (FLASH_ATTENTION_FORCE_BUILD=TRUE skips that; --no-binary refuses a
    # wheel from the index).
    FLASH_ATTENTION_FORCE_BUILD=TRUE "${PIP[@]}" install --no-build-isolation --no-binary flash-attn \
        "flash-attn==${FLASH_ATTN_VERSION}"
fi

if [[ "$BACKEND" == megatron ]]; then
    echo "== Transformer Engine ${TRANSFORMER_ENGINE_VERSION} (core wheel for CUDA 13, torch extension from its sdist)"
    NVTE_FRAMEWORK=pytorch "${PIP[@]}" install --no-build-isolation \
        "transformer_engine[core_cu13,pytorch]==${TRANSFORMER_ENGINE_VERSION}" "torch==${TORCH_VERSION}"

    mkdir -p "$BUILD_DIR"
    checkout() { # checkout URL DIR COMMIT: a clone of URL at COMMIT in DIR
        if [[ ! -d "$2/.git" ]]; then
            git clone "$1" "$2"
        fi
        git -C "$2" fetch --tags origin
        git -C "$2" checkout --detach "$3"
        [[ "$(git -C "$2" rev-parse HEAD)" == "$3" ]] || die "$2 is not at $3"
    }

    echo "== NVIDIA Apex ${APEX_COMMIT:0:8} (C++ and CUDA extensions)"
    checkout "$APEX_REPO" "$BUILD_DIR/apex" "$APEX_COMMIT"
    (cd "$BUILD_DIR/apex" && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="$MAX_JOBS" \
        "${PIP[@]}" install -v --no-build-isolation .)

    echo "== DeepEP ${DEEPEP_VERSION} (${DEEPEP_COMMIT:0:8}; TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST})"
    checkout "$DEEPEP_REPO" "$BUILD_DIR/DeepEP" "$DEEPEP_COMMIT"
    (cd "$BUILD_DIR/DeepEP" && "${PIP[@]}" install -v --no-build-isolation .)
fi

echo "== check"
BACKEND="$BACKEND" SKIP_FLASH_ATTN="$SKIP_FLASH_ATTN" "$VENV/bin/python" - <<'EOF'
import importlib
import importlib.metadata
import os
import sys

# (import name, distribution name) of every package this backend needs.
packages = [("torch", "torch"), ("vllm", "vllm"), ("transformers", "transformers"), ("verl", "verl"),
            ("respo_verl", "respo-verl")]
if os.environ["SKIP_FLASH_ATTN"] == "0":
    packages.append(("flash_attn", "flash-attn"))
if os.environ["BACKEND"] == "megatron":
    packages += [("megatron.core", "megatron-core"), ("mbridge", "mbridge"),
                 ("transformer_engine.pytorch", "transformer-engine"), ("apex", "apex"), ("deep_ep", "deep_ep")]
failed = 0
for module, dist in packages:
    try:
        importlib.import_module(module)
    except Exception as exc:  # one line per package, whatever broke
        failed += 1
        print(f"FAIL {module}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        continue
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "(no distribution metadata)"
    print(f"ok   {module} {version}")
import torch

count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"{'ok  ' if count else 'FAIL'} torch.cuda.is_available()={torch.cuda.is_available()} devices={count} "
      f"cuda={torch.version.cuda}")
sys.exit(1 if failed or not count else 0)
EOF
echo "== done: $VENV (activate with: source $VENV/bin/activate)"
