#!/bin/bash
# One device call for everything that needs the GPU: all GPU tests, then the benchmark sections
# (head, conv, taesd). Each stage has its own time limit so a slow one cannot hide the others. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; git log -1 --format='commit %H' 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee $OUT/env.txt
timeout ${TEST_S:-240} python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | tail -25
echo "pytest rc=$?"
timeout ${HEAD_S:-150} python3 -m taesd_fast.bench --sections ${SECTIONS:-head,conv} --out $OUT/bench_head_conv.txt 2>&1 | tail -60
timeout ${TAESD_S:-300} python3 -m taesd_fast.bench --sections taesd --out $OUT/bench_taesd.txt 2>&1 | tee $OUT/bench_taesd.log | tail -40
