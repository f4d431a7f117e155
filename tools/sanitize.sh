#!/bin/bash
# compute-sanitizer over every custom kernel, on small odd shapes with the optional operands on and off: memcheck
# (out-of-bounds and misaligned accesses) and racecheck (shared-memory hazards). Run from the repository root on a
# CUDA machine; logs under $OUT (default /tmp/out), a summary on stdout. Each launch script prints every kernel's
# error against its PyTorch twin and ends with "sanitize script done".
#   tools/conv_sanitize.py    the NVRTC f16 direct convs (csrc/conv3x3_f16.cu)
#   tools/head_sanitize.py    the NVRTC head kernels (conv_n128, head_stencil: csrc/head_bf16.cu)
#   tools/triton_sanitize.py  the Triton and Gluon kernels, and the CUDA C++ kernels they hand shapes to
#                             (csrc/conv_row_sm90.cu, csrc/head_g_sm90.cu); --conv-only / --head-only / --latency-only
# SANITIZE_S bounds each sanitizer call (default 300 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$CS" ]; then
  echo "compute-sanitizer not found (it ships with the CUDA toolkit)" | tee "$OUT/sanitize.log"
  exit 1
fi
: > "$OUT/sanitize.log"
# Racecheck is limited to our kernels where a launch script also runs cuDNN (racecheck on cuDNN is slow).
declare -A ONLY=([conv_sanitize.py]="--kernel-name kns=conv3x3" [head_sanitize.py]="--kernel-name kns=head_stencil")
for script in conv_sanitize.py head_sanitize.py triton_sanitize.py; do
  for tool in memcheck racecheck; do
    opts="--tool $tool"
    [ $tool = memcheck ] && opts="$opts --leak-check no" || opts="$opts ${ONLY[$script]}"
    # head_sanitize's fp32 cuDNN references are skipped under racecheck (it once crashed inside cuDNN's fp32 conv).
    light=$([ $tool = racecheck ] && echo 1 || echo 0)
    echo "== $tool tools/$script" >> "$OUT/sanitize.log"
    HEAD_SANITIZE_LIGHT=$light timeout ${SANITIZE_S:-300} $CS $opts python3 tools/$script >> "$OUT/sanitize.log" 2>&1
    echo "$tool tools/$script rc=$?" >> "$OUT/sanitize.log"
  done
done
grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|sanitize script done|rc=" "$OUT/sanitize.log"
