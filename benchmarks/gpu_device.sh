#!/usr/bin/env bash
# The GPU session's device checks in one call of under ten minutes (issue 34), run from the
# repository root of a CUDA machine whose python3 holds torch, Triton and transformers, with the
# corpus made beforehand on any machine (`python benchmarks/gpu_target.py make --out .gpu`):
#   bash benchmarks/gpu_device.sh OUTDIR [OVERHEAD_ROWS]
# overhead at a world of one (ddp, edit, ddp again by default) and the codecs alone on the
# machine; then the GPU test files start beside every algorithm on a Hugging Face Llama of
# GPT-2's size, and time to target (ddp and streaming, 180 s each) ends the call.
set -uo pipefail
out=$1 rows=${2:-ddp,edit,ddp again}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/toolkit${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$out/versions.txt"
runs=$(mktemp -d)
(cd benchmarks && python3 gpu.py --sections overhead,codecs --overhead "$rows" \
    --json "$out/gpu1.json" --keep-runs "$runs") 2>&1 | tee "$out/gpu1.log"
ddp=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['overhead']
print(next(x['tokens_per_s'] for x in r if x['algo'] == 'ddp'))" "$out/gpu1.json")
(python3 -m pytest -q -p no:cacheprovider tests/test_gpu_path.py tests/test_codecs_triton.py tests/test_outer_staging.py \
    "tests/test_acco.py::test_shard_optimizer_is_torch_adamw_and_the_estimate_leaves_it_untouched" \
    > "$out/tests.log" 2>&1; echo "exit $?" >> "$out/tests.log") &
tests=$!
(cd benchmarks && python3 gpu.py --sections e2e,target --e2e-steps 8 --ddp-tokens-per-s "$ddp" \
    --json "$out/gpu2.json" --keep-runs "$runs") 2>&1 | tee "$out/gpu2.log"
wait $tests
# the runs' records (events, configs, summaries), without weights or checkpoints
tar czf "$out/runs.tgz" --exclude='*.pt' --exclude='checkpoints' --exclude='llama' -C "$runs" . \
    2>/dev/null
