#!/usr/bin/env bash
# One device call (2x H200, `nvidia-h200-x2`): retrain the embedded demo drafter for the shipped demo target
# (cuda:0) while the docs/ablations.md variants train on cuda:1, then evaluate all on held-out stdlib files.
# Usage (device tool): bash scripts/gpu_demo_draft.sh   -> $OUT/draft/*, $OUT/results.json, $OUT/logs.tgz
set -o pipefail
cd "$(dirname "$0")/.."
[ -e dflash_zoo/adapters ] || ln -sfn ../adapters dflash_zoo/adapters  # PYTHONPATH=. has no package-dir map
export OUT="${OUT:-/tmp/gpu_demo}" PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/draft" /tmp/demo
cp -r dflash_zoo/demo/target /tmp/demo/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 570 python3 scripts/build_demo_pair.py --stage draft --ablations --device cuda:0 --ablation-device cuda:1 \
  --work /tmp/work --out /tmp/demo 2>&1 | tee "$OUT/build.log"
cp /tmp/demo/draft/* "$OUT/draft/" 2>/dev/null
cp /tmp/work/results.json "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude='*.pt' -C /tmp/work runs 2>/dev/null
python3 - <<'PY'
import json
r = json.load(open("/tmp/work/results.json"))
for k, v in r["eval"].items():
    print(k, {x: v.get(x) for x in ("mean_acceptance_length", "spec_tokens_per_second", "ar_tokens_per_second", "speedup", "outputs_match_autoregressive", "error")})
PY
