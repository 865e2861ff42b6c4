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
# With TWO_WORKERS=1 in the environment, each round also measures the router with two runtime
# threads (rr-2: round-robin, CUSTOM_ROUTER_WORKER_THREADS=2), nginx with two workers under a
# master process (nginx-2: nginx-proxy.conf with worker_processes 2; CPU and RSS of the master
# and its workers summed) and HAProxy with two threads (haproxy-2: haproxy.cfg with nbthread 2),
# from copies of the two configs in the work directory.
#
# Ports: backend 18080, nginx 18081, HAProxy 18082, nginx-2 18083, HAProxy-2 18084, the routers
# 3100-3103 (rr, qll, rr-before, rr-2). With PORT_OFFSET=N each is N higher and the work
# directory is /tmp/custom-router-wrk-N (the configs are copied there with their ports and paths
# changed), so that two runs can share a machine. A port already taken stops the run before
# anything starts: a peer that cannot bind it would leave wrk measuring someone else's server.
#
# usage: [TWO_WORKERS=1] [PORT_OFFSET=N] benches/wrk/compare.sh ROUNDS CONNS ROUTER_BINARY [BEFORE_BINARY]
#   e.g. cargo build --release && benches/wrk/compare.sh 9 32 target/release/custom-router
set -u
rounds=$1; conns=$2; router=$3; before=${4:-}
two=${TWO_WORKERS:-0}
offset=${PORT_OFFSET:-0}
W=$(cd "$(dirname "$0")" && pwd)
work=/tmp/custom-router-wrk
[ "$offset" != 0 ] && work=/tmp/custom-router-wrk-$offset
mkdir -p $work
port() { echo $(($1 + offset)); }
BACKEND=$(port 18080); NGINX=$(port 18081); HAPROXY=$(port 18082); NGINX2=$(port 18083)
HAPROXY2=$(port 18084); RRP=$(port 3100); QLP=$(port 3101); RBP=$(port 3102); R2P=$(port 3103)
for p in $BACKEND $NGINX $HAPROXY $NGINX2 $HAPROXY2 $RRP $QLP $RBP $R2P; do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then
    echo "port $p is in use (another run of compare.sh?); try PORT_OFFSET=100" >&2
    exit 1
  fi
done
# A config as it is, or (with an offset, or a changed copy's SUFFIX) a copy in the work
# directory with the ports and paths moved and EXPRESSIONS (sed) applied.
config() { # file suffix [sed expressions...]
  local file=$1 suffix=$2; shift 2
  if [ "$offset" = 0 ] && [ -z "$suffix" ]; then
    echo $W/$file
    return
  fi
  local copy=$work/${file%.*}$suffix.${file##*.}
  sed -e "s#/tmp/custom-router-wrk/#$work/#g" \
    -e "s/:18080/:$BACKEND/; s/:18081/:$NGINX/; s/:18082/:$HAPROXY/" "$@" $W/$file > $copy
  echo $copy
}
pids=()
nginx -c $(config backend.conf "") -p $work 2>/dev/null & pids+=($!)
nginx -c $(config nginx-proxy.conf "") -p $work 2>/dev/null & NX=$!; pids+=($NX)
names=(rr qll nginx)
if command -v haproxy >/dev/null; then
  haproxy -f $(config haproxy.cfg "") -db >/dev/null 2>&1 & HP=$!; pids+=($HP); names+=(haproxy)
fi
start() { # port strategy binary [env...]
  env CUSTOM_ROUTER_PORT=$1 CUSTOM_ROUTER_STRATEGY=$2 RUST_LOG=warn "${@:4}" $3 >/dev/null 2>&1 &
}
start $RRP round-robin $router; RR=$!; pids+=($RR)
start $QLP queued-least-latency $router; QL=$!; pids+=($QL)
if [ -n "$before" ]; then
  start $RBP round-robin $before; RB=$!; pids+=($RB); names+=(rr-before)
fi
if [ "$two" = 1 ]; then
  start $R2P round-robin $router CUSTOM_ROUTER_WORKER_THREADS=2; R2=$!; pids+=($R2); names+=(rr-2)
  user=""; [ "$(id -u)" = 0 ] && user="user root;"
  conf=$(config nginx-proxy.conf -2 -e "s/^worker_processes 1;/$user worker_processes 2;/" \
    -e 's/master_process off/master_process on/' -e 's/proxy\.pid/proxy-2.pid/' \
    -e 's/proxy\.err/proxy-2.err/' -e "s/:$NGINX;/:$NGINX2;/" -e 's#/cbt2;#/cbt3;#' -e 's#/pt;#/pt2;#')
  nginx -c $conf -p $work 2>/dev/null & N2=$!; pids+=($N2); names+=(nginx-2)
  if command -v haproxy >/dev/null; then
    conf=$(config haproxy.cfg -2 -e 's/nbthread 1/nbthread 2/' -e 's/haproxy\.pid/haproxy-2.pid/' \
      -e "s/:$HAPROXY\$/:$HAPROXY2/")
    haproxy -f $conf -db >/dev/null 2>&1 & H2=$!; pids+=($H2); names+=(haproxy-2)
  fi
fi
trap 'kill ${pids[@]} 2>/dev/null' EXIT
sleep 0.8
for port in $RRP $QLP $RBP $R2P; do
  curl -s -XPOST localhost:$port/_custom_router/set-backends \
    -d "{\"backends\":[\"127.0.0.1:$BACKEND\"]}" >/dev/null 2>&1
done
sleep 0.3
measure() {
  case $1 in
    rr) echo "rr $(bash $W/measure.sh $RR http://127.0.0.1:$RRP/ $conns 5)" ;;
    qll) echo "qll $(bash $W/measure.sh $QL http://127.0.0.1:$QLP/ $conns 5)" ;;
    rr-before) echo "rr-before $(bash $W/measure.sh $RB http://127.0.0.1:$RBP/ $conns 5)" ;;
    nginx) echo "nginx $(bash $W/measure.sh $NX http://127.0.0.1:$NGINX/ $conns 5)" ;;
    haproxy) echo "haproxy $(bash $W/measure.sh $HP http://127.0.0.1:$HAPROXY/ $conns 5)" ;;
    rr-2) echo "rr-2 $(bash $W/measure.sh $R2 http://127.0.0.1:$R2P/ $conns 5)" ;;
    nginx-2) echo "nginx-2 $(bash $W/measure.sh $N2 http://127.0.0.1:$NGINX2/ $conns 5)" ;;
    haproxy-2) echo "haproxy-2 $(bash $W/measure.sh $H2 http://127.0.0.1:$HAPROXY2/ $conns 5)" ;;
  esac
}
count=${#names[@]}
for round in $(seq 0 $((rounds - 1))); do
  for i in $(seq 0 $((count - 1))); do
    measure ${names[$(( (round + i) % count ))]}
  done
done
