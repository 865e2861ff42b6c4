#!/bin/bash
# Runs wrk against URL with CONNS connections and reports req/s, the CPU microseconds PID spent per
# request (from /proc/PID/stat), p50/p99 latency and PID's RSS; with the process's children
# (nginx's workers under a master process) summed in. Needs wrk (Debian package).
# usage: measure.sh PID URL CONNS SECONDS -> req/s, cpu us/req, rss
pid=$1; url=$2; c=$3; d=${4:-5}
pids="$pid $(cat /proc/$pid/task/*/children 2>/dev/null)"
cpu() { for p in $pids; do awk '{print $14+$15}' /proc/$p/stat; done | awk '{s+=$1} END {print s}'; }
before=$(cpu)
out=$(wrk -t1 -c$c -d${d}s -s "$(dirname "$0")/post.lua" --latency $url 2>&1)
after=$(cpu)
reqs=$(echo "$out" | awk '/requests in/ {print $1}')
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
p50=$(echo "$out" | awk '$1=="50%" {print $2}')
p99=$(echo "$out" | awk '$1=="99%" {print $2}')
ticks=$(getconf CLK_TCK)
us=$(python3 -c "print(round(($after-$before)/$ticks*1e6/$reqs,1))")
rss=$(for p in $pids; do awk '/VmRSS/ {print $2}' /proc/$p/status; done | awk '{s+=$1} END {print s}')
echo "rps=$rps cpu_us_per_req=$us p50=$p50 p99=$p99 rss_kb=$rss"
