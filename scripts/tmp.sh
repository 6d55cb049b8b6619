#!/usr/bin/env bash
out=$1
bash scripts/gpu-check.sh run $out/run > $out/run.txt 2>&1; echo "run rc=$?"; grep -E "PASSED|FAILED|Failure|gpu-check:|ERROR SUMMARY" $out/run.txt | head -20
rm -rf $out/run
bash scripts/gpu-check.sh bench $out/bench > $out/bench.txt 2>&1; echo "bench rc=$?"
grep -E "^\| (8|16|128) \| (1|9|64) \|" $out/bench/mla_verify.md | grep -E "\| 1 \| [0-9.]+ \|" | cut -d'|' -f2-8,13-15 | head -40
