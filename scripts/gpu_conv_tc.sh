#!/bin/bash
# One device call for the Triton tensor-core conv (kernels/conv_tc.py): benchmark + sweep first (the numbers), then
# the GPU tests. Each stage has its own time limit so a slow one cannot hide the other. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } | tee $OUT/env_tc.txt
timeout ${BENCH_S:-220} python3 scripts/bench_conv_tc.py --out $OUT/bench_conv_tc.txt --budget-s ${BUDGET_S:-150} 2>&1 \
  | tee $OUT/bench_conv_tc.log | tail -25
echo "bench rc=$?"
timeout ${TEST_S:-330} python3 -m pytest tests/gpu/test_conv_tc_gpu.py -q -rs -p no:cacheprovider --durations=8 2>&1 \
  | tee $OUT/pytest_conv_tc.log | grep -v "PASSED" | tail -40
echo "pytest rc=$?"
