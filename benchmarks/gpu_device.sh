#!/usr/bin/env bash
# The GPU session's device checks in one call of under ten minutes (issues 34 and 48), run from
# the repository root of a CUDA machine whose python3 holds torch, Triton and transformers, with
# the corpus made beforehand on any machine (`python benchmarks/gpu_target.py make --out .gpu`):
#   bash benchmarks/gpu_device.sh OUTDIR [OVERHEAD_ROWS] [TARGET_SECONDS]
# overhead at a world of one (the guard's cost in two alternating pairs, and Muon's) and the
# codecs alone on the machine; then the GPU test files start beside every algorithm on a Hugging
# Face Llama of GPT-2's size (four runs at a time), streaming with one replica 2x slower (fixed
# against speed-aware local steps, alone), and time to target (ddp and streaming) ends the call.
# Each part has its own time limit, so a part that hangs leaves the later ones their time; every
# part writes its JSON under OUTDIR as it goes, and its output to OUTDIR/all.log.
set -uo pipefail
out=$1
rows=${2:-ddp,streaming,streaming guard off,ddp muon,streaming muon,streaming guard off again,streaming again,ddp again}
target=${3:-70}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/toolkit${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$out/all.log"
# lowband doctor's CUDA and NCCL lines, and gloo over loopback on the device's host (a few s)
timeout -k 5 60 python3 -m lowband.doctor 2>&1 | tee -a "$out/all.log"
# Muon's step, torch's per-matrix loop against lowband's batches (BatchedMuon), GPT-2's shapes
(cd benchmarks && timeout -k 5 60 python3 muon_step.py --models mini,small,gpt2 --device cuda \
    --json "$out/muon.json") 2>&1 | tee -a "$out/all.log"
runs=$(mktemp -d)
gpu() {  # gpu LIMIT NAME ARGS...: one call of benchmarks/gpu.py, its JSON in OUTDIR/NAME.json
    local limit=$1 name=$2
    shift 2
    (cd benchmarks && timeout -k 10 "$limit" python3 gpu.py --json "$out/$name.json" \
        --keep-runs "$runs" "$@") 2>&1 | tee -a "$out/all.log"
    echo "[$name] ended at $((SECONDS - start)) s" | tee -a "$out/all.log"
}
gpu 150 gpu1 --sections overhead,codecs --overhead "$rows"
ddp=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['overhead']
print(next(x['tokens_per_s'] for x in r if x['algo'] == 'ddp'))" "$out/gpu1.json" || echo 380000)
echo "ddp at a world of one: $ddp tokens/s (380000: the 2026-11-26 figure, where none was measured)" \
    | tee -a "$out/all.log"
(timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_path.py \
    tests/test_codecs_triton.py tests/test_outer_staging.py \
    "tests/test_acco.py::test_shard_optimizer_is_torch_adamw_and_the_estimate_leaves_it_untouched" \
    > "$out/tests.log" 2>&1; echo "exit $?" >> "$out/tests.log") &
tests=$!
gpu 110 gpu2 --sections e2e --e2e-steps 8 --e2e-parallel 4 \
    --e2e "ddp,diloco,streaming,zero1,acco,edit,aedit"
gpu 70 gpu3 --sections e2e --e2e "streaming slow,streaming slow adaptive"
wait $tests
gpu $((2 * target + 90)) gpu4 --sections target --ddp-tokens-per-s "$ddp" \
    --target-seconds "$target"
# the runs' records (events, configs, summaries), without weights or checkpoints
tar czf "$out/runs.tgz" --exclude='*.pt' --exclude='checkpoints' --exclude='llama' -C "$runs" . \
    2>/dev/null
echo "all parts ended at $((SECONDS - start)) s" | tee -a "$out/all.log"
