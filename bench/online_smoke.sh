#!/usr/bin/env bash
# A first real online run on the default target: a code -> chat stream (online split), served
# with the untrained draft target-layers:2 (k = 2), once learning online and once static.
# Results: runs/online-smoke/{online,static}/ (report.md, alpha.png, events.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/online-smoke
mkdir -p $OUT
onlinespec data stream --out $OUT/stream.jsonl --domains code,chat --every 100 --schedule abrupt
onlinespec online --stream $OUT/stream.jsonl --json $OUT/online.json --out-dir $OUT/online \
  --max-new-tokens 32 --update-interval 20 --steps-per-update 20 --lr 3e-4 --positions verified
onlinespec online --stream $OUT/stream.jsonl --json $OUT/static.json --out-dir $OUT/static \
  --max-new-tokens 32 --static
onlinespec report online=$OUT/online.json static=$OUT/static.json --out-dir docs/results/online-smoke \
  --title "Online vs static draft (target-layers:2, k = 2), code -> chat stream"
