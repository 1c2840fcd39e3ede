#!/usr/bin/env bash
# #26 item 7: Seq1F1B k=4 compute and k=8 even against 1F1B, today's code (878cccb) and the slab (main), alternating.
set -u
export PATH=/work/main/.venv/bin:$PATH
for round in 1 2; do
  order="old new"; [ $round = 2 ] && order="new old"
  for co in $order; do
    touch /work/main/.venv/.torchtitan_seq-installed
    cd /tmp/$co && PYTHONPATH=/tmp/$co python benchmarks/bench.py --schedules 1F1B,Seq1F1B:4:compute,Seq1F1B:8:even \
      --seq-lens 2048,4096 --steps 4 --rounds 1 --out /tmp/ab26/$co/r$round > /tmp/ab26_${co}_r$round.log 2>&1
    echo "$co r$round rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab26.log
  done
done
