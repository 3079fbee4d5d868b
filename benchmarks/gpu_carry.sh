#!/usr/bin/env bash
# gpu_carry.sh: builds the "carry kit", the wheels that must travel to the remote GPU machine.
# That machine has NO network. It has python 3.12 (x86_64, manylinux), torch 2.11.0+cu130, triton,
# transformers, numpy, pillow, safetensors, tokenizers, xxhash, jinja2, pyyaml, tqdm, huggingface-hub,
# httpx, anyio, h11, click, requests, pytest(-timeout, -xdist), typing-extensions, ninja, sentencepiece,
# tiktoken, einops, nvidia-ml-py, tabulate, packaging, psutil, uvloop, cuda-bindings and cupy, but not
# what vlm_serve serves with (av, fastapi, uvicorn, pyzmq, pydantic, xgrammar), the test client (openai)
# or flashinfer. One remote call carries at most 64 MiB in all (work tree + carried paths), and the repo
# already takes ~10.7 MB, so the kit comes in two sets, one per call:
#   base        everything serving needs (and the openai client)
#   flashinfer  flashinfer-python (JIT: kernels are compiled with the machine's nvcc at first use)
#               and its dependencies the machine lacks
#
# Usage (here, with network):  bash benchmarks/gpu_carry.sh base|flashinfer|all
#   empties .whl/ in the repo root, downloads exactly that set's pinned wheels into it, keeps .whl/
#   git-ignored (.git/info/exclude), prints each wheel's size and the total with the files that travel,
#   and exits non-zero if that total is over 64 MiB (67108864 bytes).
# Then carry ".whl" with the remote call (run's `carry`), and there, first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# The two sets can go to the same /tmp/site on one warm machine, one call after the other; each also
# installs on its own (both carry apache-tvm-ffi and typing-extensions, at the same versions).
#
# Pins are the versions installed on the development machine, so both machines run the same code.
set -euo pipefail

LIMIT=67108864  # 64 MiB: all that one remote call carries

BASE=(
    # the project's dependencies the GPU machine lacks
    av==18.1.0
    fastapi==0.165.0
    starlette==1.10.0
    annotated-doc==0.0.7          # fastapi
    opentelemetry-api==1.45.2     # fastapi
    uvicorn==0.54.0
    pyzmq==27.3.0
    pydantic==2.13.4
    pydantic-core==2.46.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    xgrammar==0.2.8
    apache-tvm-ffi==0.1.15.post2  # xgrammar (>=0.1.11)
    # the OpenAI client the tests use
    openai==3.57.0
    distro==1.9.0
    jiter==0.19.0
    sniffio==1.3.1
    httpx2==2.16.2                # openai
    httpcore2==2.16.2             # httpx2
    truststore==0.10.5            # httpx2, httpcore2
    # the GPU machine has these, but of versions not known here; these wheels are small and meet the
    # floors of the wheels above (pydantic-core: typing-extensions>=4.14.1, httpx2: idna>=3.18,
    # openai: anyio>=4.10, httpcore2: h11>=0.16)
    typing-extensions==4.16.0
    idna==3.20
    anyio==4.16.0
    h11==0.16.0
)

# flashinfer 0.5.3: the smallest wheel (7.0 MB; 0.7.2.post1 is 62 MB) that has the paged prefill/decode
# wrappers vlm_serve calls, JIT-compiles them with CUDA 13's nvcc (it adds $CUDA_HOME/include/cccl) and
# takes apache-tvm-ffi >=0.1,<0.2, so the same tvm-ffi as xgrammar's. Its other dependencies the GPU
# machine has, except nvidia-cudnn-frontend and nvidia-cutlass-dsl: neither is imported by
# `import flashinfer` (cudnn behind try/except, CuTe-DSL kernels only from flashinfer.cute_dsl), nor used
# by the paged attention wrappers, and cutlass-dsl's CUDA 13 libraries alone are 92 MB.
# Its JIT build needs, beside nvcc: curand_kernel.h for the sm90 (FA3) prefill, which an H100 gets (if
# $CUDA_HOME/include lacks it, torch's nvidia-curand wheel has it: FLASHINFER_EXTRA_CUDAFLAGS="-isystem
# <site-packages>/nvidia/cu13/include"), and, to link, libcudart.so in $CUDA_HOME/lib64 and a libcuda.so
# (unversioned) the linker finds (else FLASHINFER_EXTRA_LDFLAGS="-L<dir with a libcuda.so link>").
FLASHINFER=(
    flashinfer-python==0.5.3
    apache-tvm-ffi==0.1.15.post2
    typing-extensions==4.16.0     # apache-tvm-ffi needs >=4.13
)

case "${1:-}" in
    base) PINS=("${BASE[@]}") ;;
    flashinfer) PINS=("${FLASHINFER[@]}") ;;
    all) PINS=("${BASE[@]}" flashinfer-python==0.5.3) ;;  # both in one call, where they fit beside the repo
    *) echo "usage: $0 base|flashinfer|all" >&2; exit 2 ;;
esac

ROOT=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
cd "$ROOT"
DIR=.whl

# keep .whl/ out of git (and so out of the work tree a call copies, unless carried)
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
touch "$EXCLUDE"
grep -qxF '/.whl/' "$EXCLUDE" || echo '/.whl/' >> "$EXCLUDE"

rm -rf "$DIR"
mkdir -p "$DIR"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${PINS[@]}"

shopt -s nullglob
wheels=("$DIR"/*.whl)
if [ "${#wheels[@]}" -ne "${#PINS[@]}" ]; then
    echo "error: ${#PINS[@]} pins but ${#wheels[@]} wheels in $DIR/" >&2
    exit 1
fi

# what a remote call copies: tracked files and untracked ones git does not ignore (as on disk now)
repo_bytes=$(git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -f "$f" ] && [ ! -L "$f" ] && printf '%s\0' "$f"; done \
    | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}')

whl_bytes=0
echo "set $1: ${#wheels[@]} wheels in $DIR/"
for w in "${wheels[@]}"; do
    size=$(stat -c %s "$w")
    whl_bytes=$((whl_bytes + size))
    printf '%12d  %s\n' "$size" "${w#"$DIR"/}"
done
total=$((whl_bytes + repo_bytes))
printf '%12d  wheels\n%12d  repo files (tracked + untracked, not ignored)\n%12d  total (limit %d, 64 MiB; %d left)\n' \
    "$whl_bytes" "$repo_bytes" "$total" "$LIMIT" "$((LIMIT - total))"
if [ "$total" -gt "$LIMIT" ]; then
    echo "error: over the 64 MiB a remote call carries" >&2
    exit 1
fi
