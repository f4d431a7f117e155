#!/bin/bash
# Session device run: pending head GPU tests, the B=1 decode timeline, the small-conv launch sweep, the head SiLU probe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee $OUT/env.txt
timeout 120 python3 -m pytest tests/gpu/test_head_fused_gpu.py -k "opcheck or spec_ready" -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest_pending.log | tail -5
timeout 70 python3 scripts/decode_timeline.py --size 256 2>&1 | tee $OUT/timeline_256_b1.txt | head -60
timeout 230 python3 scripts/small_conv_sweep.py 2>&1 | tee $OUT/small_conv_sweep.txt
timeout 90 python3 scripts/head_wgmma_probe.py 4 baseline,tanh 2>&1 | tee $OUT/head_probe.txt
