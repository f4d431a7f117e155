export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/tfc TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
mkdir -p $OUT
{ date -u; git log -1 --format='commit %H'; git status --short | head; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt
timeout 270 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/pytest_gpu.log
timeout 150 python3 -m taesd_fast.bench --sections head --out $OUT/bench_head.txt > $OUT/bench_head.log 2>&1; echo "bench rc=$?"; grep -E "^\|? ?\(i\)|\(c\)|\(a\)|\(g\)" $OUT/bench_head.txt | head -12
timeout 60 compute-sanitizer --tool memcheck python3 scripts/triton_sanitize.py --head-only > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; tail -3 $OUT/memcheck.log
timeout 70 compute-sanitizer --tool racecheck python3 scripts/triton_sanitize.py --head-only > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?"; tail -3 $OUT/racecheck.log
