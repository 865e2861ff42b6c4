#!/bin/bash
# Interleaved comparison at one concurrency: the router (round-robin and queued-least-latency),
# nginx (benches/wrk/nginx-proxy.conf), HAProxy (benches/wrk/haproxy.cfg, when installed) and,
# optionally, a second router binary with round-robin (say, an earlier commit's build), all
# proxying to the static backend of benches/wrk/backend.conf. Each round measures every proxy
# once with measure.sh (5 s of wrk), in an order rotated from round to round, so that a machine
# that speeds up or slows down during the run does not favour one of them. Needs wrk and nginx
# (Debian packages; haproxy optional). Prints one line per measurement:
#   NAME rps=... cpu_us_per_req=... p50=... p99=... rss_kb=...
#
# usage: benches/wrk/compare.sh ROUNDS CONNS ROUTER_BINARY [BEFORE_BINARY]
#   e.g. cargo build --release && benches/wrk/compare.sh 9 32 target/release/custom-router
set -u
rounds=$1; conns=$2; router=$3; before=${4:-}
W=$(cd "$(dirname "$0")" && pwd)
work=/tmp/custom-router-wrk
mkdir -p $work
pids=()
nginx -c $W/backend.conf -p $work 2>/dev/null & pids+=($!)
nginx -c $W/nginx-proxy.conf -p $work 2>/dev/null & NX=$!; pids+=($NX)
names=(rr qll nginx)
if command -v haproxy >/dev/null; then
  haproxy -f $W/haproxy.cfg -db >/dev/null 2>&1 & HP=$!; pids+=($HP); names+=(haproxy)
fi
start() { # port strategy binary
  CUSTOM_ROUTER_PORT=$1 CUSTOM_ROUTER_STRATEGY=$2 RUST_LOG=warn $3 >/dev/null 2>&1 &
}
start 3100 round-robin $router; RR=$!; pids+=($RR)
start 3101 queued-least-latency $router; QL=$!; pids+=($QL)
if [ -n "$before" ]; then
  start 3102 round-robin $before; RB=$!; pids+=($RB); names+=(rr-before)
fi
trap 'kill ${pids[@]} 2>/dev/null' EXIT
sleep 0.8
for port in 3100 3101 3102; do
  curl -s -XPOST localhost:$port/_custom_router/set-backends \
    -d '{"backends":["127.0.0.1:18080"]}' >/dev/null 2>&1
done
sleep 0.3
measure() {
  case $1 in
    rr) echo "rr $(bash $W/measure.sh $RR http://127.0.0.1:3100/ $conns 5)" ;;
    qll) echo "qll $(bash $W/measure.sh $QL http://127.0.0.1:3101/ $conns 5)" ;;
    rr-before) echo "rr-before $(bash $W/measure.sh $RB http://127.0.0.1:3102/ $conns 5)" ;;
    nginx) echo "nginx $(bash $W/measure.sh $NX http://127.0.0.1:18081/ $conns 5)" ;;
    haproxy) echo "haproxy $(bash $W/measure.sh $HP http://127.0.0.1:18082/ $conns 5)" ;;
  esac
}
count=${#names[@]}
for round in $(seq 0 $((rounds - 1))); do
  for i in $(seq 0 $((count - 1))); do
    measure ${names[$(( (round + i) % count ))]}
  done
done
