#!/usr/bin/env bash
# One call on a lent GPU machine (the workplace's `device` tool): build _C for
# sm_90 against the machine's own torch, run the gpu-marked tests, then the GPU
# benchmarks. Every step gets a share of one deadline so the call always ends
# with its logs. Results go to $OUT (at most 8 files come back):
#   log.txt, bench_kernels_cuda.{csv,png}, bench_update_cuda.csv,
#   bench_update_hostcost.csv, update_host_syncs.jsonl,
#   class_stats_variants_cuda.csv, gpu_machine.json. bench/cuda_probe.py first names the cases
#   whose kernels fault, and bench_kernels leaves them out.
#
#   STEPS="tests variants probe kernels update" TESTS="tests" bash bench/device_run.sh [deadline seconds, default 540]
set -u
DEADLINE=${1:-540}
STEPS=" ${STEPS:-tests variants probe kernels update} "
want() { [[ $STEPS == *" $1 "* ]]; }
OUT=${OUT:-/tmp/d9d_device_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}

left() { echo $((DEADLINE - SECONDS)); }
step() {  # step NAME CAP CMD...: run CMD with min(CAP, time left - 10 s)
  local name=$1 cap=$2; shift 2
  local t; t=$(($(left) - 10)); ((t > cap)) && t=$cap
  if ((t < 20)); then echo "== $name: skipped (no time left)" | tee -a "$LOG"; return 1; fi
  echo "== $name (limit ${t}s, at ${SECONDS}s)" | tee -a "$LOG"
  timeout "$t" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after ${SECONDS}s" | tee -a "$LOG"
  return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
$PY - "$OUT/gpu_machine.json" <<'PY' >>"$LOG" 2>&1  # read by bench/report.py's GPU sections
import json, subprocess, sys, datetime, torch, triton
q = "name,memory.total,driver_version"
smi = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
json.dump({"gpu": smi.stdout.strip(), "date": str(datetime.date.today()),
           "software": f"torch {torch.__version__}, triton {triton.__version__} (the lent machine's image; "
                       "_C built there for sm_90)"}, open(sys.argv[1], "w"))
PY
if ls .whl/*.whl >/dev/null 2>&1; then  # test/bench references missing from the image (torcheval)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# pure-Python packages copied from a venv where no wheel is at hand; last on
# the path, so the image's own copies win
[[ -d .whl/site ]] && export PYTHONPATH="$PYTHONPATH:$PWD/.whl/site"

rm -f d9d_kernels/_C*.so
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 D9D_KERNELS_BUILD_CUDA=1
step build 300 $PY setup.py -q build_ext --inplace || { tail -60 "$LOG"; exit 1; }
$PY -c "import d9d_kernels as dk, torch; print('backends', dk.ops.backends(), torch.cuda.get_device_name())" >>"$LOG" 2>&1

want tests && step gpu_tests 200 $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs --timeout 150 \
  --continue-on-collection-errors ${TESTS:-tests}
grep -E " passed| failed" "$LOG" | tail -2

want variants && step class_stats_variants 60 $PY bench/cuda_probe.py --class-stats-variants \
  --out "$OUT/class_stats_variants_cuda.csv"
want probe && step cuda_probe 90 $PY bench/cuda_probe.py --sanitize --failed-to /tmp/probe_failed
want kernels && step bench_kernels 150 $PY bench/bench_kernels.py --device cuda --quick --out "$OUT/bench_kernels_cuda.csv" \
  --skip $(cat /tmp/probe_failed 2>/dev/null)
want update && step bench_update 90 $PY bench/bench_update.py --device cuda --quick --segmentation off \
  --providers d9d torchmetrics torcheval plain_torch --out "$OUT/bench_update_cuda.csv"
echo "== done at ${SECONDS}s" | tee -a "$LOG"
grep -E "^\| |FAILED|ERROR|^E " "$LOG" | tail -80
