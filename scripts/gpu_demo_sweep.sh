#!/usr/bin/env bash
# One device call (one H200): how much should the demo target memorise? Trains demo targets for EPOCHS passes
# over the stdlib corpus (shipped tokenizer), a drafter for each on freshly regenerated data, and evaluates each
# pair on the held-out files. All candidates share the GPU in parallel processes, so compare them with each
# other, not with a drafter trained alone.
# Usage (device tool): EPOCHS="2 6 16" bash scripts/gpu_demo_sweep.sh
#   -> $OUT/eE_target.tar, $OUT/eE_draft.tar per candidate, $OUT/results.tgz (results.json + logs of each)
set -o pipefail
cd "$(dirname "$0")/.."
[ -e dflash_zoo/adapters ] || ln -sfn ../adapters dflash_zoo/adapters  # PYTHONPATH=. has no package-dir map
export OUT="${OUT:-/tmp/gpu_sweep}" PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
EPOCHS="${EPOCHS:-2 6 16}" DRAFT_S="${DRAFT_S:-220}" BUDGET="${BUDGET:-560}" DEVICE="${DEVICE:-cuda}"
SIZES="${SIZES:---set n_text=16000 --set n_chat=2000}"  # CPU smoke test: SIZES=--tiny DEVICE=cpu
mkdir -p "$OUT" /tmp/sweep
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for e in $EPOCHS; do
  timeout "$BUDGET" python3 scripts/build_demo_pair.py --stage all --device "$DEVICE" --tokenizer dflash_zoo/demo/target \
    --work "/tmp/sweep/w$e" --out "/tmp/sweep/d$e" --set target_epochs="$e" --set draft_s="$DRAFT_S" \
    $SIZES > "/tmp/sweep/e$e.log" 2>&1 &
done
wait
for e in $EPOCHS; do
  d=/tmp/sweep/d$e
  tar cf "$OUT/e${e}_target.tar" -C "$d" target 2>/dev/null
  tar cf "$OUT/e${e}_draft.tar" -C "$d" draft 2>/dev/null
  python3 - "$d/results.json" "$e" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print(f"epochs {sys.argv[2]}: no results"))
m = r["eval"]["main"]
print(f"epochs {sys.argv[2]}:", r["target"], r["target_report"],
      {k: m.get(k) for k in ("mean_acceptance_length", "spec_tokens_per_second", "ar_tokens_per_second", "speedup")},
      {k: r["drafters"]["main"].get(k) for k in ("steps", "loss", "tau", "examples")})
PY
done
tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='home' \
  --exclude='draft_data.jsonl' --exclude='tokens.bin' /tmp/sweep 2>/dev/null
ls -la "$OUT"
