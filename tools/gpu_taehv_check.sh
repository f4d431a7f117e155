#!/bin/bash
# TAEHV on one GPU, in about 4 minutes: the GPU tests, the per-layer profile, decode_video's peak memory as the clip
# grows (chunked), and upstream's taehv.py as a peer where .upstream/taehv.py exists (carry it; it is not in git).
# Run from the repository root; logs under $OUT (default /tmp/out), at most 7 files:
#   env.txt  pytest_taehv_gpu.log  profile_taehv_taew2_2.md  profile.log  taehv_memory.md  upstream_taehv.md
#   upstream.log
# Stage limits (seconds; 0 skips a stage), overridable from the environment: TEST_S 110, PROFILE_S 60, MEMORY_S 45,
# UPSTREAM_S 50. COMPILE=1 adds upstream's torch.compile max-autotune rows (minutes: raise UPSTREAM_S with it).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
TEST_S=${TEST_S:-110} PROFILE_S=${PROFILE_S:-60} MEMORY_S=${MEMORY_S:-45} UPSTREAM_S=${UPSTREAM_S:-50}
limit() { timeout -k 10 "$@"; }
{ date -u; git log -1 --format='commit %H' 2>/dev/null; git status --short | head -20
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/env.txt"
if [ "$TEST_S" != 0 ]; then
  limit "$TEST_S" python3 -m pytest tests/gpu/test_taehv_gpu.py -q -rs -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_taehv_gpu.log" | grep -E "rel err|peak|beyond|passed|failed|error|Error" | tail -40
  echo "GPU tests rc=${PIPESTATUS[0]} (124: out of time)"
fi
if [ "$PROFILE_S" != 0 ]; then
  limit "$PROFILE_S" python3 tools/profile_taehv.py --variant taew2_2 --latents 31 --size 704x1280 2>&1 \
    | tee "$OUT/profile.log" | tail -25
  echo "profile rc=${PIPESTATUS[0]} (124: out of time)"
fi
if [ "$MEMORY_S" != 0 ]; then
  limit "$MEMORY_S" python3 tools/taehv_memory.py --variant taew2_2 --latents 31,61,121 --size 704x1280 2>&1 \
    | tail -20
  echo "memory rc=${PIPESTATUS[0]} (124: out of time)"
fi
if [ "$UPSTREAM_S" != 0 ] && [ -f .upstream/taehv.py ]; then
  limit "$UPSTREAM_S" python3 tools/bench_upstream_taehv.py .upstream/taehv.py $([ "$COMPILE" = 1 ] || echo --no-compile) \
    2>&1 | tee "$OUT/upstream.log" | tail -25
  echo "upstream peer rc=${PIPESTATUS[0]} (124: out of time; rows finished are in $OUT/upstream.log)"
elif [ "$UPSTREAM_S" != 0 ]; then
  echo "no .upstream/taehv.py: the upstream peer is skipped (copy madebyollin/taehv's taehv.py there and carry it)"
fi
