#!/usr/bin/env bash
# Continue training the embedded demo drafter on a GPU (one device call): fewer anchors per sequence than the
# first build (32 instead of 512) so each step is cheap and the time budget buys many more steps.
# Usage (device tool): bash scripts/retrain_demo_draft.sh   (writes $OUT/draft, $OUT/eval.json, $OUT/log.txt)
set -eo pipefail
cd "$(dirname "$0")/.."
[ -e dflash_zoo/adapters ] || ln -sfn ../adapters dflash_zoo/adapters
export OUT="${OUT:-/tmp/retrain}" PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
python3 - <<'PY'
import hashlib, json, random, sysconfig
from pathlib import Path
root = Path(sysconfig.get_paths()["stdlib"])
files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
train = [p for p in files if int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(), 16) % 20 != 0]
rng, lines = random.Random(7), []
while len(lines) < 6000:
    text = rng.choice(train).read_text(errors="ignore")
    if len(text) > 400:
        s = rng.randrange(len(text) - 300)
        lines.append({"text": text[s : s + 1500]})
Path("/tmp/retrain_data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
PY
python3 -m dflash_zoo train --target dflash_zoo/demo/target --data /tmp/retrain_data.jsonl --out "$OUT/draft" \
  --init dflash_zoo/demo/draft --regenerate --max-new-tokens 256 --regen-batch-size 1024 --draft-layers 3 \
  --batch-size 32 --anchors-per-seq 32 --epochs 100 --time-budget "${TRAIN_SECONDS:-300}" --device cuda --seed 1 \
  --json > "$OUT/train.json" 2> "$OUT/train.log"
tail -c 600 "$OUT/train.json"
python3 -m dflash_zoo eval --target dflash_zoo/demo/target --draft "$OUT/draft" --data build/gpu/demo/logs/held_out.jsonl \
  --max-new-tokens 256 --device cuda --limit 10 --json --no-baseline > "$OUT/eval.json" 2> "$OUT/eval.log"
head -c 800 "$OUT/eval.json"
