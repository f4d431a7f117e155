#!/bin/bash
# Device run for the B=1 decode work: chain kernel tests and bench, the decode timeline, the B=1 rows, head tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee $OUT/env.txt
timeout 150 python3 -m pytest tests/gpu/test_conv_chain_gpu.py -q -rs -x -p no:cacheprovider 2>&1 | tee $OUT/pytest_chain.log | tail -15
timeout 120 python3 scripts/bench_chain.py 2>&1 | tee $OUT/bench_chain.txt
timeout 70 python3 scripts/decode_timeline.py --size 256 2>&1 | tee $OUT/timeline_256_b1.txt | head -50
timeout 120 python3 -m taesd_fast.bench --sections taesd --no-compile --workloads "256² B=1,512² B=1,1024² B=1" --out $OUT/bench_taesd_b1.txt 2>&1 | tail -12
[ -n "$HEAD_TESTS" ] && timeout 150 python3 -m pytest tests/gpu/test_head_fused_gpu.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest_head.log | tail -5
true
