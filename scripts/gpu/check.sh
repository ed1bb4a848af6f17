#!/bin/bash
# The GPU check (`make test-gpu`), from the repository root of a machine with a CUDA GPU, in about 8 minutes on
# one H200: the tests marked `gpu` (FSDP2 bf16 step, the engine on CUDA, the NCCL broadcast between two GPUs
# when there are two, CUDA-IPC weight sync colocated on one GPU, memory release and resume, 20 GRPO steps of
# make demo's task colocated on one GPU), the refusal of colocated NCCL, and the generation and train-step
# benches on CUDA (bf16, tokens/s, MFU) at two real models' shapes with random weights.
# With .gpu/ (scripts/gpu/bundle.sh) it installs the carried packages into a folder of its own and needs no
# network; without, it runs with $PYTHON (default .venv/bin/python, else python3) as it is.
# Logs and results go to $OUT (default /tmp/verst-gpu-check): one log per step, rl.json, summary.txt.
#   STEPS=tests,refusal,bench  bash scripts/gpu/check.sh
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/verst-gpu-check}
STEPS=${STEPS:-tests,refusal,bench}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error VERST_GPU_OUT="$OUT"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-450}  # the whole check ends within 8 minutes: each step gets at most what is left
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
limit() { local left=$(( BUDGET_S - ($(date +%s) - T0) )); [ "$1" -lt "$left" ] && echo "$1" || echo $(( left > 5 ? left : 5 )); }

if [ -d .gpu/whl ]; then
  SITE=${SITE:-/tmp/verst-gpu-site}
  if [ ! -f "$SITE/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/whl/*.whl || exit 1
    tar xJf .gpu/ray.tar.xz -C "$SITE" || exit 1
    touch "$SITE/.installed"
  fi
  PY=python3
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  # `verst` for the Ray actors and the refusal step: the package from this checkout
  mkdir -p "$SITE/bin" && printf '#!/bin/sh\nexec python3 -m verst.cli.main "$@"\n' > "$SITE/bin/verst"
  chmod +x "$SITE/bin/verst" && export PATH="$SITE/bin:$PATH"
else
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
log "setup done ($PY)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
$PY -c "import torch, transformers, ray; print('torch', torch.__version__, 'transformers', transformers.__version__,
'ray', ray.__version__, 'GPUs', torch.cuda.device_count())" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"

case $STEPS in *tests*)
  log "tests marked gpu"
  timeout "$(limit 260)" $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" --timeout=240 -rA -s \
    > "$OUT/gpu_tests.log" 2>&1
  log "tests rc=$?: $(grep -E '^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed' "$OUT/gpu_tests.log" | tail -12 | tr '\n' ' ')"
esac
case $STEPS in *refusal*)
  log "colocated with the distributed transport on CUDA: refused by name at config load"
  $PY -m verst.cli.main train recipes/grpo_addition.toml --schedule sync --cluster.device cuda \
    --cluster.placement colocated --sync.transport distributed --dry-run > "$OUT/refusal.log" 2>&1
  grep -q "NCCL refuses two ranks of one group on one GPU" "$OUT/refusal.log" && log "refused: ok" || log "NOT REFUSED"
esac
case $STEPS in *bench*)
  for model in smollm2-135m-shape qwen3-0.6b-shape; do
    log "engine throughput, $model"
    timeout "$(limit 60)" $PY bench/engine_throughput.py --device cuda --model "$model" --requests 512 --batch 128 \
      --no-http --no-vllm > "$OUT/engine_$model.log" 2>&1
    log "rc=$?: $(grep -E 'tok/s|ratio' "$OUT/engine_$model.log" | tr -s ' ' | tr '\n' ';')"
    log "train throughput, $model"
    timeout "$(limit 45)" $PY bench/train_throughput.py --device cuda --model "$model" --batch 128 --max-tokens 16384 \
      --steps 3 --ranks 1 --no-checkpointing > "$OUT/train_$model.log" 2>&1
    log "rc=$?: $(grep -E 'tokens/s|MFU|overhead|CUDA memory' "$OUT/train_$model.log" | tr -s ' ' | tr '\n' ';')"
  done
esac
log "done"
