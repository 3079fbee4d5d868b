#!/usr/bin/env bash
# The GPU validation kit as one command on a lent GPU machine (no network), run from the repo's root with
# the wheels of `benchmarks/gpu_carry.sh all` carried in .whl/:
#
#   bash benchmarks/gpu_kit.sh OUT [SECONDS] [STEPS]
#
# It installs the wheels (FlashInfer into a folder of its own), then runs vlm_serve.tools.gpu_check's
# STEPS (default torch,flashinfer,suite), each in a share of the SECONDS left (default 420; the last step all of it); a step can name
# its parts, joined by "+", for a rerun of some (e.g. flashinfer:figures+parity,suite):
#   torch: parity and server without FlashInfer (the torch attention backend; its figures and profile,
#     eager decode bound by kernel launches, were measured on an H200: `torch:figures+profile` reruns them);
#   flashinfer: parity, figures (bandwidth, TTFT split) and profile (timelines: dense and MoE at batch 1, the
#     picture's TTFT, batch 160) with FlashInfer (where it runs: half precision, its head sizes);
#   suite: the model tests under pytest on CUDA (FlashInfer installed), for the time left; its parts are test
#     files (e.g. suite:test_engine+test_speculative).
# Each step's records go under OUT/<step>/ and are packed into OUT/kit.tgz (a call returns 8 files at most).
set -uo pipefail

OUT=${1:?usage: gpu_kit.sh OUT [SECONDS]}
BUDGET=${2:-420}
STEPS=${3:-torch,flashinfer,suite}
START=$SECONDS
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

wheels=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(printf '%s\n' "${wheels[@]}" | grep -v flashinfer) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fi \
    .whl/flashinfer*.whl || exit 1
export PYTHONPATH=/tmp/site
# the project itself, editable from this tree (its dependencies are the wheels above)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
# FlashInfer's JIT build: curand's headers, where CUDA's own include folder lacks them; all cores
CURAND=$(python3 -c 'import nvidia, os; print(next((os.path.join(p, "cu13", "include") for p in nvidia.__path__ if os.path.isfile(os.path.join(p, "cu13", "include", "curand_kernel.h"))), ""))' 2>/dev/null)
[ -n "$CURAND" ] && export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $CURAND"
export MAX_JOBS=$(nproc)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

left() { echo $((BUDGET - (SECONDS - START))); }
kit() {  # kit NAME SHARE-OF-THE-TIME-LEFT(%) ARGS...: one run of the kit, its records under OUT/NAME
    local name=$1 share=$2
    shift 2
    timeout $(( $(left) * share / 100 )) python3 -m vlm_serve.tools.gpu_check "$OUT/$name" "$@" 2>&1 \
        | tee "$OUT/$name.log" | grep -E '^\[|^device|^FAIL|error'
}
steps=(${STEPS//,/ })
for step in "${steps[@]}"; do
    parts=
    [[ $step == *:* ]] && parts=${step#*:} && parts=${parts//+/,}
    last=0 && [[ $step == "${steps[-1]}" ]] && last=1  # the last step takes all the time left
    case $step in
        torch*) kit torch $((last ? 95 : 30)) --parts ${parts:-parity,server} ;;
        flashinfer*) PYTHONPATH=$PYTHONPATH:/tmp/fi kit flashinfer $((last ? 95 : 60)) --parts ${parts:-parity,figures,profile} ;;
        suite*) PYTHONPATH=$PYTHONPATH:/tmp/fi kit suite 95 --parts suite --test-timeout 120 \
            ${parts:+--suite-files $parts} ;;
    esac
done
(cd "$OUT" && tar czf kit.tgz --remove-files $(ls -d torch* flashinfer* suite* 2>/dev/null))
echo "kit: $((SECONDS - START)) s"
