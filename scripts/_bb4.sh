export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/tfc_bb4 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
{ date -u; git log -1 --format='commit %H'; git status --short | head; } > $OUT/env.txt
S=$(date +%s)
timeout 170 python3 -m pytest tests/gpu/test_conv_halo_gpu.py -q -rA -p no:cacheprovider > $OUT/pytest_halo.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-S ))s"; grep -c PASSED $OUT/pytest_halo.log; grep "FAILED\|passed\|failed" $OUT/pytest_halo.log | tail -6
S=$(date +%s)
timeout 40 compute-sanitizer --tool memcheck python3 scripts/triton_sanitize.py --conv-only > $OUT/mem.log 2>&1; echo "mem rc=$? $(( $(date +%s)-S ))s"; grep "SUMMARY" $OUT/mem.log
timeout 75 python3 -m taesd_fast.bench --sections taesd --no-compile --workloads "decode 256² B=1" --out $OUT/bench_taesd.txt > $OUT/bench.log 2>&1; echo "bench rc=$?"; tail -12 $OUT/bench.log
