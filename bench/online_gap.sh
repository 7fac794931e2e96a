#!/bin/bash
# Does `online` draft worse than `bench` on the same traffic? (docs/faster-drafts.md, section 2)
# The same 40 standard-library functions (online split), 48 new tokens, every way the paths differ.
# About 15 minutes on 2 CPUs; run it alone. Results: runs/gap/*.json (the `online` rows carry tau and alpha).
set -ex
B=${ONLINESPEC:-onlinespec}
W=runs/gap
mkdir -p $W
$B data stream --out $W/stdlib40.jsonl --domains stdlib --every 40
$B data stream --out $W/mixed60.jsonl --domains stdlib,chat,math_ml --schedule random --every 20
P=$W/stdlib40.jsonl
run() { name=$1; shift; rm -rf $W/o-$name; $B online --json $W/online-$name.json --out-dir $W/o-$name --max-new-tokens 48 "$@"; }
$B bench --prompts $P --json $W/bench.json --draft hybrid --k 4 --max-new-tokens 48 --adaptive-k --no-hf
run static --stream $P --static
run learn --stream $P --learn --suffix-tokens 0 --update-interval 10
run suffix --stream $P --learn --no-head-updates
run c4 --stream $P --static --concurrency 4
run c4-k2 --stream $P --static --concurrency 4 --fixed-k -k 2
run c4-none --stream $P --static --concurrency 4 --draft none
run mixed-single --stream $W/mixed60.jsonl --learn --no-head-updates --suffix-tokens 0 --router single --concurrency 4
run mixed-domain --stream $W/mixed60.jsonl --learn --no-head-updates --suffix-tokens 0 --router domain --concurrency 4
