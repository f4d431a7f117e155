#!/bin/bash
# Everything that needs the GPU, in calls that each fit the device's 10-minute limit per command. Run from the
# repository root on a CUDA machine; logs and tables under $OUT (default /tmp/out).
#
#   bash tools/gpu_all.sh 1    GPU tests (tests/gpu in five groups of files run at once)
#                              + the taesd section (TAESD vs eager / channels_last / graph / torch.compile)
#   bash tools/gpu_all.sh 2    first use (tools/bench_first_use.py: fresh processes with empty caches, then a second
#                              process on the caches the first left) + the taehv section (TAEHV vs plain PyTorch)
#   bash tools/gpu_all.sh 3    the head and conv sections + the sanitizers (tools/sanitize.sh: memcheck and
#                              racecheck on every kernel)
#   bash tools/gpu_all.sh all  every stage in one go (well over 10 minutes: for a machine without that limit)
# Without an argument: call 1. Calls 1 and 2 give the figures issues 25 and 26 ask for (first use, TAESD and TAEHV
# beside torch.compile, the GPU suite); call 3 re-measures the per-kernel tables and runs the sanitizers. The stage
# limits of each call add up to 540 s, so a call ends inside 10 minutes even when every stage runs out of time.
# The taehv section measures its cheap rows first and torch.compile max-autotune last, printing each row as it
# finishes, so a time limit cuts only the last max-autotune rows (rerun those with TAEHV_ARGS="--workloads ...").
#
# Each stage has its own time limit (seconds; 0 skips it) so a slow one cannot hide the others. A variable set in
# the environment overrides the call's default:
#   TEST_S       GPU tests                                          call 1: 300
#   TAESD_S      taesd section, TAESD_ARGS extra arguments          call 1: 240   (e.g. "--no-compile --workloads B=1")
#   FIRST_USE_S  tools/bench_first_use.py, FIRST_USE_ARGS extra     call 2: 150   (e.g. "--blocking")
#   TAEHV_S      taehv section, TAEHV_ARGS extra arguments          call 2: 390   (e.g. "--no-compile --workloads step")
#   HEAD_S       the sections in SECTIONS (default head,conv)      call 3: 60
#   SANITIZE_S   each of tools/sanitize.sh's 6 sanitizer runs        call 3: 80
#   CONV_TC      shape filter for tools/bench_conv_tc.py (empty: skip), CONV_TC_S its limit (170)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
set -o pipefail
CALL=${1:-1}
if [ -n "$FIRST_USE$SANITIZE" ]; then
  echo "FIRST_USE=1 / SANITIZE=1 are replaced by calls: 'bash tools/gpu_all.sh 2' runs first use, '... 3' the sanitizers" >&2
  exit 2
fi
case $CALL in
  1) defaults=(300 240 0 0 0 0) ;;
  2) defaults=(0 0 150 0 390 0) ;;
  3) defaults=(0 0 0 60 0 80) ;;
  all) defaults=(600 300 300 150 600 300) ;;
  *) echo "usage: bash tools/gpu_all.sh [1|2|3|all] (got '$CALL'); see the header for what each call runs" >&2; exit 2 ;;
esac
TEST_S=${TEST_S:-${defaults[0]}} TAESD_S=${TAESD_S:-${defaults[1]}} FIRST_USE_S=${FIRST_USE_S:-${defaults[2]}}
HEAD_S=${HEAD_S:-${defaults[3]}} TAEHV_S=${TAEHV_S:-${defaults[4]}} SANITIZE_S=${SANITIZE_S:-${defaults[5]}}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
# A stage that runs out of time gets SIGTERM, then SIGKILL 10 s later (timeout signals the stage's whole group).
limit() { timeout -k 10 "$@"; }
{ date -u; echo "call $CALL"; git log -1 --format='commit %H' 2>/dev/null; git status --short | head -20
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee $OUT/env.txt
if [ "$TEST_S" != 0 ]; then  # five groups of test files at once (compiles are CPU-bound; ~270 s on the H200)
  G=tests/gpu
  group() { name=$1; shift
    TAESD_FAST_CACHE_DIR=/tmp/taesd_fast_cache_$name limit $TEST_S python3 -m pytest "$@" -q -rs -p no:cacheprovider \
      --durations=8 > $OUT/pytest_gpu_$name.log 2>&1
    echo "GPU tests $name rc=$? (124: out of time): $(tail -1 $OUT/pytest_gpu_$name.log)"; }
  group tuning $G/test_tuning_gpu.py &
  group taehv_graphs $G/test_taehv_gpu.py $G/test_graphs_gpu.py $G/test_taehv_video_graphs_gpu.py &
  group head $G/test_head_fused_gpu.py $G/test_head_kernels.py $G/test_head_module_gpu.py &
  group conv_rows $G/test_conv_rows_gpu.py $G/test_conv_tc_gpu.py $G/test_compile_pool_gpu.py &
  group conv_taesd $G/test_conv_kernels.py $G/test_taesd_kernels_gpu.py $G/test_value_range_gpu.py $G/test_dispatch_gpu.py \
    $G/test_taehv_real_size_gpu.py $G/test_mem_conv_gpu.py $G/test_triton_frames_gpu.py &
  wait
  left=$(ls $G/test_*.py | grep -v -E "test_(tuning|taehv|taehv_real_size|taehv_video_graphs|graphs|dispatch|head_fused|head_kernels|head_module|conv_rows|conv_tc|compile_pool|conv_kernels|taesd_kernels|value_range|mem_conv|triton_frames)_?gpu|test_(head_kernels|conv_kernels)\.py")
  [ -z "$left" ] || echo "GPU test files in no group (add them above): $left"
fi
if [ -n "$CONV_TC" ]; then
  limit ${CONV_TC_S:-170} python3 tools/bench_conv_tc.py --out $OUT/bench_conv_tc.txt --budget-s $(( ${CONV_TC_S:-170} - 25 )) \
    --shapes "$CONV_TC" 2>&1 | tee $OUT/bench_conv_tc.log | grep -A40 "best config per shape"
fi
if [ "$TAESD_S" != 0 ]; then
  limit $TAESD_S python3 -m taesd_fast.apps.bench --sections taesd $TAESD_ARGS --out $OUT/bench_taesd.txt 2>&1 \
    | tee $OUT/bench_taesd.log | tail -40
  echo "taesd section rc=${PIPESTATUS[0]} (124: out of time)"
fi
if [ "$FIRST_USE_S" != 0 ]; then  # its own new cache folders (--keep must not exist), so no stage above warms them
  FRESH=$(mktemp -d)
  limit $FIRST_USE_S python3 tools/bench_first_use.py --keep "$FRESH/caches" $FIRST_USE_ARGS 2>&1 \
    | tee $OUT/first_use.log | tail -30
  echo "first use rc=${PIPESTATUS[0]} (124: out of time; table also in $OUT/first_use.txt, raw figures in $OUT/first_use.json)"
fi
if [ "$HEAD_S" != 0 ] && [ -n "${SECTIONS-head,conv}" ]; then
  limit $HEAD_S python3 -m taesd_fast.apps.bench --sections ${SECTIONS-head,conv} --out $OUT/bench_head_conv.txt 2>&1 \
    | tee $OUT/bench_head_conv.log | tail -60
  echo "head, conv sections rc=${PIPESTATUS[0]} (124: out of time)"
fi
if [ "$TAEHV_S" != 0 ]; then  # rows are printed as measured (lines "  taew..."), then the table; compile logs only in the log
  limit $TAEHV_S python3 -m taesd_fast.apps.bench --sections taehv $TAEHV_ARGS --out $OUT/bench_taehv.txt 2>&1 \
    | tee $OUT/bench_taehv.log | grep -E "^(GPU |== |  taew|workload|taew)|Error|Traceback|error:" | tail -90
  echo "taehv section rc=${PIPESTATUS[0]} (124: out of time; the rows it finished are above and in $OUT/bench_taehv.log)"
fi
if [ "$SANITIZE_S" != 0 ]; then
  SANITIZE_S=$SANITIZE_S bash tools/sanitize.sh
fi
