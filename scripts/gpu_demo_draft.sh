#!/usr/bin/env bash
# One device call: retrain the embedded demo drafter for the shipped demo target (cuda:0) while the
# docs/ablations.md variants train beside it (ABL_DEVICE: cuda:0 on one GPU, cuda:1 on a 2-GPU host), then
# evaluate all on held-out stdlib files (ABLATIONS=0: the main drafter alone). EXTRA passes build_demo_pair.py flags (--init, --set KEY=VALUE ...).
# Usage (device tool): ABL_DEVICE=cuda:0 EXTRA="--init dflash_zoo/demo/draft" bash scripts/gpu_demo_draft.sh
#   -> $OUT/draft/*, $OUT/results.json, $OUT/logs.tgz
set -o pipefail
cd "$(dirname "$0")/.."
[ -e dflash_zoo/adapters ] || ln -sfn ../adapters dflash_zoo/adapters  # PYTHONPATH=. has no package-dir map
export OUT="${OUT:-/tmp/gpu_demo}" PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/draft" /tmp/demo
cp -r dflash_zoo/demo/target /tmp/demo/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# shellcheck disable=SC2086  # EXTRA is a list of flags
[ "${ABLATIONS:-1}" = 0 ] || EXTRA="--ablations $EXTRA"
timeout "${BUDGET:-560}" python3 scripts/build_demo_pair.py --stage draft --device cuda:0 \
  --ablation-device "${ABL_DEVICE:-cuda:1}" --work /tmp/work --out /tmp/demo $EXTRA 2>&1 | tee "$OUT/build.log"
cp /tmp/demo/draft/* "$OUT/draft/" 2>/dev/null
cp /tmp/work/results.json "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude='*.pt' -C /tmp/work runs held_out.jsonl 2>/dev/null
python3 - <<'PY'
import json
r = json.load(open("/tmp/work/results.json"))
for k, v in r["eval"].items():
    print(k, {x: v.get(x) for x in ("mean_acceptance_length", "spec_tokens_per_second", "ar_tokens_per_second", "speedup", "outputs_match_autoregressive", "error")})
PY
