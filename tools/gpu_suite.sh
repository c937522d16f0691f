#!/usr/bin/env bash
# The GPU benchmark in one command, for a CUDA machine without internet (e.g. a lent H100/H200).
#
#   bash tools/gpu_suite.sh [OUT_DIR] [BENCH ARGS...]        (default OUT_DIR: ${OUT:-bench_out}/gpu)
#   TOME_GPU_PART=dit bash tools/gpu_suite.sh [OUT_DIR]      the transformer part instead (kv against merge): Flux 1024²,
#       Qwen-Image 1328², Z-Image 1024², Wan 832x480x33, LTX-2 768x512x33, bf16, --blocks 2, vanilla, kv at 0.5/0.75
#       and merge at 0.25/0.5/0.75 (add `--frames 121` for LTX-2 at the issue's length)
#
# That machine needs torch (CUDA build), transformers, accelerate, safetensors and numpy; diffusers and
# tomesd travel as wheels: on a machine with internet, from the repository root,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 tomesd==0.1.3 importlib_metadata==8.7.0
# and copy .whl/ along (ignored by git). This script installs them into /tmp/site when .whl/ exists.
# It runs `python -m tome_core bench --gpu-suite` (SD1.5 512/1024/2048 and SDXL 1024/2048 eager, every
# case profiled with CUDA activity, SD1.5 1024 compiled; under 8 minutes on one H100) under a timeout,
# so a stalled part still leaves results.json with the rows done so far, and writes the GPU's name,
# the driver and the package versions beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench_out}/gpu}"
python="${PYTHON:-python3}"  # the interpreter with the CUDA torch
mkdir -p "$out"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=99
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true) > "$out/gpu.txt" 2>&1
"$python" -c "import torch, diffusers, tomesd; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'diffusers', diffusers.__version__, 'tomesd', getattr(tomesd, '__version__', '?'))" >> "$out/gpu.txt" 2>&1
if [ "${TOME_GPU_PART:-unet}" = dit ]; then
  suite=(--families flux,qwen_image,z_image,wan,ltx2 --blocks 2 --device cuda --dtype bf16 --repeats 3 --max-repeats 5
         --methods vanilla,kv@0.5,kv@0.75,merge@0.25,merge@0.5,merge@0.75)
else
  suite=(--gpu-suite)
fi
timeout "${TOME_GPU_SUITE_TIMEOUT:-470}" "$python" -m tome_core bench "${suite[@]}" --no-progress --out "$out" "${@:2}" \
  2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
echo "gpu suite exit status: $status (124 = stopped by the timeout; results.json holds the rows done)" | tee -a "$out/log.txt"
exit "$status"
