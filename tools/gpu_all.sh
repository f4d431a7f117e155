#!/bin/bash
# One call on a CUDA machine for everything that needs the GPU: the GPU tests, then the benchmarks, then (when asked)
# the sanitizers. Run from the repository root. Each stage has its own time limit so a slow one cannot hide the
# others; a stage whose variable is empty or 0 is skipped. Logs under $OUT (default /tmp/out).
#   TEST_S      pytest tests/gpu limit (240; 0 skips)
#   CONV_TC     shape filter for tools/bench_conv_tc.py (empty: skip), CONV_TC_S its limit (170)
#   SECTIONS    taesd_fast.bench sections besides taesd (head,conv), HEAD_S their limit (150)
#   TAESD_ARGS  extra arguments for the taesd section (e.g. "--no-compile --workloads B=1"), TAESD_S (300; 0 skips)
#   FIRST_USE   1: tools/bench_first_use.py with empty caches, then again with the caches it left (empty: skip)
#   SANITIZE    1: tools/sanitize.sh (compute-sanitizer memcheck + racecheck on every kernel; empty: skip)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; git log -1 --format='commit %H' 2>/dev/null; git status --short | head -20
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee $OUT/env.txt
if [ "${TEST_S:-240}" != 0 ]; then
  timeout ${TEST_S:-240} python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | tail -25
  echo "pytest rc=$?"
fi
if [ -n "$CONV_TC" ]; then
  timeout ${CONV_TC_S:-170} python3 tools/bench_conv_tc.py --out $OUT/bench_conv_tc.txt --budget-s $(( ${CONV_TC_S:-170} - 25 )) \
    --shapes "$CONV_TC" 2>&1 | tee $OUT/bench_conv_tc.log | grep -A40 "best config per shape"
fi
if [ -n "${SECTIONS-head,conv}" ]; then
  timeout ${HEAD_S:-150} python3 -m taesd_fast.bench --sections ${SECTIONS-head,conv} --out $OUT/bench_head_conv.txt 2>&1 | tail -60
fi
if [ "${TAESD_S:-300}" != 0 ]; then
  timeout ${TAESD_S:-300} python3 -m taesd_fast.bench --sections taesd $TAESD_ARGS --out $OUT/bench_taesd.txt 2>&1 \
    | tee $OUT/bench_taesd.log | tail -40
fi
if [ -n "$FIRST_USE" ]; then  # fresh caches of its own, so the stages above do not warm them
  FRESH=$(mktemp -d)
  for tag in cold warm; do
    TAESD_FAST_CACHE_DIR=$FRESH/taesd_fast TRITON_CACHE_DIR=$FRESH/triton TORCHINDUCTOR_CACHE_DIR=$FRESH/inductor \
      timeout 300 python3 tools/bench_first_use.py $tag 2>&1 | tee -a $OUT/first_use.log
  done
fi
if [ -n "$SANITIZE" ]; then
  OUT=$OUT bash tools/sanitize.sh
fi
