#!/usr/bin/env bash
set -u
export PATH=/work/main/.venv/bin:$PATH
log=/tmp/mem26/log
echo "start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $log
touch /work/main/.venv/.torchtitan_seq-installed
cd /work/main && python benchmarks/bench.py --schedules Seq1F1B:4:compute,Seq1F1B:4:even,Seq1F1B:8:even,InterleavedSeq1F1B:4:compute,TeraPipe:4:latency,BSIPipe:4:compute,Chimera:4:compute,Chimera:1:even \
  --seq-lens 2048,4096 --steps 2 --rounds 1 --out /tmp/mem26/new > /tmp/mem26/new.log 2>&1
echo "new rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $log
touch /work/main/.venv/.torchtitan_seq-installed
cd /tmp/old && PYTHONPATH=/tmp/old python benchmarks/bench.py --schedules InterleavedSeq1F1B:4:compute,TeraPipe:4:latency,BSIPipe:4:compute,Chimera:4:compute,Chimera:1:even \
  --seq-lens 4096 --steps 2 --rounds 1 --out /tmp/mem26/old > /tmp/mem26/old.log 2>&1
echo "old rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $log
