#!/usr/bin/env bash
# #26 item 7 with K/V arenas: Seq1F1B k=4 compute and k=8 even against 1F1B, today's code (878cccb, checked
# out at /tmp/old with main's .venv linked) and this checkout (a worktree of it at /tmp/new, main's .venv linked), alternating: old-new in round 1, new-old in round 2.
set -u
export PATH=/work/main/.venv/bin:$PATH
out=${OUT:-/tmp/ab_arena}
declare -A tree=([old]=/tmp/old [new]=/tmp/new)
for round in 1 2; do
  order="old new"; [ $round = 2 ] && order="new old"
  for co in $order; do
    touch /work/main/.venv/.torchtitan_seq-installed
    cd ${tree[$co]} && PYTHONPATH=${tree[$co]} python benchmarks/bench.py --schedules 1F1B,Seq1F1B:4:compute,Seq1F1B:8:even \
      --seq-lens ${SEQ_LENS:-2048,4096} --steps 4 --rounds 1 --out $out/$co/r$round > $out/${co}_r$round.log 2>&1
    echo "$co r$round rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log
  done
done
