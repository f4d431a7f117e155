#!/bin/bash
# compute-sanitizer over every custom kernel, on small odd shapes with the optional operands on and off: memcheck
# (out-of-bounds and misaligned accesses) and racecheck (shared-memory hazards). Run from the repository root on a
# CUDA machine:
#   bash tools/sanitize.sh [SCRIPT ...]      (default: the three below)
# Each launch script NaN-poisons the kernels' outputs, prints every launch's error against a float64 reference
# (computed on the CPU), exits 1 on a mismatch and ends with "sanitize script done":
#   tools/triton_sanitize.py  every kernel row of the dispatcher (kernels/rows.py) through its own run: the Triton,
#                             Gluon and CUDA C++ conv and head kernels and the SIMT convs (--conv-only, --head-only,
#                             --rows NAME,...)
#   tools/conv_sanitize.py    the SIMT f16 direct convs (csrc/conv3x3_f16.cu), every variant, stride 1 and 2
#   tools/head_sanitize.py    the split head (conv_n128, head_stencil: csrc/head_bf16.cu), bands, raw stencil launches
# Logs under $OUT (default /tmp/out), a summary on stdout; the exit status is 1 if any script failed or any sanitizer
# reported an error. SANITIZE_S bounds each sanitizer call (default 300 s); SANITIZE_TOOLS picks the tools
# (default "memcheck racecheck").
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$CS" ]; then
  echo "compute-sanitizer not found (it ships with the CUDA toolkit)" | tee "$OUT/sanitize.log"
  exit 1
fi
: > "$OUT/sanitize.log"
# Racecheck is limited to our kernels where a launch script also runs cuDNN / cuBLAS (racecheck on them is slow).
declare -A ONLY=([conv_sanitize.py]="--kernel-name kns=conv3x3" [head_sanitize.py]="--kernel-name kns=head_stencil")
status=0
for script in ${@:-triton_sanitize.py conv_sanitize.py head_sanitize.py}; do
  script=$(basename "$script")
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    opts="--tool $tool --error-exitcode 99"
    [ $tool = memcheck ] && opts="$opts --leak-check no" || opts="$opts ${ONLY[$script]}"
    echo "== $tool tools/$script" >> "$OUT/sanitize.log"
    timeout ${SANITIZE_S:-300} $CS $opts python3 tools/$script >> "$OUT/sanitize.log" 2>&1
    rc=$?
    echo "$tool tools/$script rc=$rc" >> "$OUT/sanitize.log"
    [ $rc = 0 ] || status=1
  done
done
grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|FAILED|sanitize script done|rc=" "$OUT/sanitize.log"
exit $status
