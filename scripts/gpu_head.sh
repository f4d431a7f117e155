#!/bin/bash
# One device call for the bf16 head path: GPU tests, benchmark, compute-sanitizer. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee $OUT/gpu.txt
python -m pytest tests/gpu/test_head_kernels.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest_head.log
echo "pytest rc=$?"
python -m taesd_fast.bench --sections head --out $OUT/bench_head.txt 2>&1 | tee $OUT/bench_head.log
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  timeout 100 $CS --tool memcheck --leak-check no python scripts/head_sanitize.py > $OUT/sanitize.log 2>&1
  echo "memcheck rc=$?" >> $OUT/sanitize.log
  HEAD_SANITIZE_LIGHT=1 timeout 70 $CS --tool racecheck --kernel-name kns=head_stencil python scripts/head_sanitize.py >> $OUT/sanitize.log 2>&1
  echo "racecheck rc=$?" >> $OUT/sanitize.log
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|band max|sanitize script done|rc=|Error|error" $OUT/sanitize.log | head -40
else
  echo "compute-sanitizer not found" | tee $OUT/sanitize.log
fi
