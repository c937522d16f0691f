#!/usr/bin/env bash
# The GPU benchmark in one command, for a CUDA machine without internet (e.g. a lent H100/H200): every part under
# its own time limit, in the order that matters most, each leaving its results even when stopped by its limit.
#
#   bash tools/gpu_suite.sh [OUT_DIR]                       every part, under 8 minutes (default OUT_DIR: ${OUT:-bench_out}/gpu)
#   TOME_GPU_PART=dit bash tools/gpu_suite.sh [OUT_DIR]     one part: dit | attn | check | unet | fixed | compile (or a comma list)
#
# Parts (seconds of limit in a whole run; a part run alone gets TOME_GPU_PART_LIMIT, default 470):
#   dit      110  Flux 1024², Qwen-Image 1328², Z-Image 1024², Wan 832x480x33, LTX-2 768x512x33, bf16, --blocks 2:
#                 vanilla, kv r=0.5, merge r=0.5, every case profiled (trace summaries), steady-state timing
#   attn      30  Qwen-Image 1328² merge r=0.5 with plain against balanced merge_attention (its default): what the
#                 mask costs on the GPU (SDPA leaves flash for the kernel the `attention` column names), profiled
#   check     60  the speed check's verdict against the bench's steady ratio (tome_bench.experiments.speed_check_accuracy)
#   unet     160  python -m tome_core bench --gpu-suite unet: SD1.5 512/1024/2048², SDXL 1024/2048², fp16, the hosts'
#                 default (merge-auto), merge-level, kv r=0.75, tomesd; every case profiled
#   fixed     60  tome_bench.experiments.fixed_cost --device cuda: vanilla and each patch alternated (SD1.5 512², SDXL 1024²)
#   compile   60  python -m tome_core bench --gpu-suite compile: SD1.5 and SDXL 1024², vanilla, merge-level, kv r=0.75,
#                 inductor and inductor + CUDA graphs, each row written as it compiles (a whole run reaches what 60 s
#                 allow; TOME_GPU_PART=compile alone gets 470 s)
#
# That machine needs torch (CUDA build), transformers, accelerate, safetensors and numpy; diffusers and tomesd travel
# as wheels in .whl/ (ignored by git; ../shared/gpu/prepare_wheels.sh, or on a machine with internet:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 tomesd==0.1.3 importlib_metadata==8.7.0
# ), installed into /tmp/site. Writes OUT_DIR/<part>/ (results.json, results.md, traces/), OUT_DIR/gpu.txt (the GPU,
# driver, packages), OUT_DIR/log.txt, and OUT_DIR/gpu_results.json: every part's JSON in one file
# ({"parts": {...}}), the file docs/results takes and the README's GPU table is written from
# (python -m tome_bench.doc_tables README.md; see docs/BENCHMARK.md).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="$(mkdir -p "${1:-${OUT:-bench_out}/gpu}" && cd "${1:-${OUT:-bench_out}/gpu}" && pwd)"
python="${PYTHON:-python3}"  # the interpreter with the CUDA torch
case "$python" in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac  # parts run elsewhere
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=99
device="${TOME_GPU_DEVICE:-cuda}"  # cpu: the same commands on tiny models, to check the script (no figure)
exec > >(tee -a "$out/log.txt") 2>&1
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true) > "$out/gpu.txt" 2>&1
"$python" -c "import torch, diffusers, tomesd, tome_core; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'diffusers', diffusers.__version__, 'tomesd', getattr(tomesd, '__version__', '?'), 'tome', tome_core.__version__)" >> "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

parts="${TOME_GPU_PART:-all}"
[ "$parts" = all ] && parts="dit,attn,check,unet,fixed,compile"
alone=$([ "${TOME_GPU_PART:-all}" = all ] && echo "" || echo "${TOME_GPU_PART_LIMIT:-470}")
if [ "$device" = cpu ]; then
  bench=(-m tome_core bench --no-progress --device cpu --tiny)
  dit_args=(--families flux,z_image --methods vanilla,kv@0.5,merge@0.5 --profile)
  attn_args=(--families qwen_image --methods vanilla,merge-plain,merge-bal --profile)
  unet_args=(--families sd15 --methods vanilla,merge-auto,kv@0.75 --profile)
  compile_args=(--families sd15 --methods vanilla,kv@0.75 --compile-mode default,reduce-overhead)
  check_args=(--tiny --device cpu); fixed_args=(--device cpu 64)
else
  bench=(-m tome_core bench --no-progress --device cuda)
  dit_args=(--families flux,qwen_image,z_image,wan,ltx2 --blocks 2 --dtype bf16 --repeats 3 --max-repeats 4
            --budget 90 --methods vanilla,kv@0.5,merge@0.5 --profile)
  attn_args=(--families qwen_image --blocks 2 --dtype bf16 --repeats 3 --max-repeats 3 --methods
             vanilla,merge-plain,merge-bal --profile)
  unet_args=(--gpu-suite unet --budget 140)
  compile_args=(--gpu-suite compile --repeats 2 --max-repeats 2)
  check_args=(--device cuda); fixed_args=(--device cuda)
fi

run() {  # run NAME LIMIT COMMAND...: under its limit, from its own folder (experiments write their JSON there)
  local name="$1" limit="${alone:-$2}" start=$SECONDS
  shift 2
  mkdir -p "$out/$name"
  echo "=== $name (limit ${limit}s) $(date +%T)"
  (cd "$out/$name" && timeout "$limit" "$python" "$@")
  echo "=== $name exit $? in $((SECONDS - start))s (124 = stopped by its limit; what it finished is kept)"
}
for part in ${parts//,/ }; do
  case "$part" in
    dit) run dit 110 "${bench[@]}" "${dit_args[@]}" --out "$out/dit" ;;
    attn) run attn 30 "${bench[@]}" "${attn_args[@]}" --out "$out/attn" ;;
    check) run check 60 -m tome_bench.experiments.speed_check_accuracy "${check_args[@]}" ;;
    unet) run unet 160 "${bench[@]}" "${unet_args[@]}" --out "$out/unet" ;;
    fixed) run fixed 60 -m tome_bench.experiments.fixed_cost "${fixed_args[@]}" ;;
    compile) run compile 60 "${bench[@]}" "${compile_args[@]}" --out "$out/compile" ;;
    *) echo "unknown part $part: dit, attn, check, unet, fixed, compile"; exit 2 ;;
  esac
done
"$python" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {}
for path in sorted(out.glob("*/*.json")):
    try:
        parts[f"{path.parent.name}/{path.stem}"] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"skipped {path}: {e}")
gpu = (out / "gpu.txt").read_text() if (out / "gpu.txt").exists() else ""
(out / "gpu_results.json").write_text(json.dumps({"gpu": gpu, "parts": parts}, indent=1, default=str))
print(f"wrote {out / 'gpu_results.json'}: {', '.join(parts) or 'no part finished'}")
PY
