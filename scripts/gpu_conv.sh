#!/bin/bash
# One device call for the f16 conv kernels: NVRTC without a toolkit, GPU tests, compute-sanitizer,
# conv benchmark. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=$(command -v python3)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee $OUT/gpu.txt
# 1. No toolkit: no CUDA_HOME, no nvcc on PATH, no toolkit libs; a fresh cache forces an NVRTC compile.
env -u CUDA_HOME -u CUDA_PATH -u LD_LIBRARY_PATH PATH=/usr/bin:/bin TAESD_FAST_CACHE_DIR=/tmp/nocache $PY -c "
import time, torch, taesd_fast._backend as b
t = time.time(); r = b.kernels_unavailable_reason(); print('no-toolkit reason:', r, f'{time.time()-t:.2f}s')
x = torch.randn(1, 64, 33, 35, device='cuda').half(); w = torch.randn(64, 64, 3, 3, device='cuda').half()
t = time.time(); y = torch.ops.taesd_fast.conv3x3_f16(x, w, None, None, 1, True, 'rb'); torch.cuda.synchronize()
print('first conv (compile+load+run)', f'{time.time()-t:.2f}s', 'nvrtc', b._nvrtc_version())
print([l.split()[-1] for l in open('/proc/self/maps') if 'nvrtc' in l][:2])
" 2>&1 | tee $OUT/nvrtc_notoolkit.log
# 2. Tests (conv + dispatch + TAESD forced kernels).
timeout 300 python3 -m pytest tests/gpu/test_conv_kernels.py tests/gpu/test_dispatch_gpu.py tests/gpu/test_taesd_kernels_gpu.py \
  --maxfail=15 -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | grep -v "^tests/.*PASSED" | tail -60
echo "pytest rc=$?"
# 3. compute-sanitizer on every variant.
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  timeout 90 $CS --tool memcheck --leak-check no python3 scripts/conv_sanitize.py > $OUT/sanitize.log 2>&1
  echo "memcheck rc=$?" >> $OUT/sanitize.log
  timeout 90 $CS --tool racecheck --kernel-name kns=conv3x3 python3 scripts/conv_sanitize.py >> $OUT/sanitize.log 2>&1
  echo "racecheck rc=$?" >> $OUT/sanitize.log
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|done|rc=|rror" $OUT/sanitize.log | head -30
else
  echo "compute-sanitizer not found" | tee $OUT/sanitize.log
fi
# 4. Auto-mode choices on a whole TAEF2 encode+decode, then the conv benchmark section.
timeout 120 python3 scripts/taesd_auto_table.py 2>&1 | tee $OUT/taesd_auto_table.txt | tail -45
timeout 150 python3 -m taesd_fast.bench --sections conv --out $OUT/bench_conv.txt 2>&1 | tail -50
