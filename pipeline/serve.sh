#!/usr/bin/env bash
# `make serve`: the embedded Prefect setup for this repository, all local and offline.
#   1. `prefect server start` on 127.0.0.1:4200, SQLite under .prefect/ (PREFECT_HOME)
#   2. the `shiftlab` process work pool (one flow run at a time: runs share this workspace)
#   3. the deployments of prefect.yaml (`prefect deploy --all`)
#   4. a process worker pulling from the pool
# Each background process records its pid in .prefect/<name>.pid; `make stop` stops them.
# Logs: .prefect/server.log, .prefect/worker.log. Re-running it starts only what is not running.
# Environment knobs: SHIFTLAB_PREFECT_PORT (4200), SHIFTLAB_PREFECT_HOST (address the server
# listens on, 127.0.0.1; 0.0.0.0 for workers on other machines), SHIFTLAB_WORK_POOL (shiftlab),
# SHIFTLAB_POOL_CONCURRENCY (1), SHIFTLAB_SERVE_TIMEOUT (seconds to wait for the server, 180).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.venv/bin"
HOST=127.0.0.1                                  # where local commands reach the server
BIND="${SHIFTLAB_PREFECT_HOST:-127.0.0.1}"      # 0.0.0.0 to let workers on other machines in
PORT="${SHIFTLAB_PREFECT_PORT:-4200}"
POOL="${SHIFTLAB_WORK_POOL:-shiftlab}"
# The knobs are checked before anything starts (a bad one would fail after the server is up).
refuse() { echo "serve: error: $1; nothing was started" >&2; exit 2; }
whole() { [[ "$2" =~ ^[0-9]{1,9}$ ]] && ((10#$2 >= 1)) || refuse "$1=$2: not a whole number >= 1"; }
[[ "$PORT" =~ ^[0-9]{1,5}$ ]] && ((10#$PORT >= 1 && 10#$PORT <= 65535)) || refuse "SHIFTLAB_PREFECT_PORT=$PORT: not a TCP port number (1-65535)"
whole SHIFTLAB_POOL_CONCURRENCY "${SHIFTLAB_POOL_CONCURRENCY:-1}"
whole SHIFTLAB_SERVE_TIMEOUT "${SHIFTLAB_SERVE_TIMEOUT:-180}"
export PREFECT_HOME="$ROOT/.prefect"
export PREFECT_API_URL="http://$HOST:$PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 DVC_NO_ANALYTICS=1 GX_ANALYTICS_ENABLED=false
export SHIFTLAB_ROOT="$ROOT" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$BIN:$PATH"
mkdir -p "$PREFECT_HOME"

running() { [[ -f "$PREFECT_HOME/$1.pid" ]] && kill -0 "$(cat "$PREFECT_HOME/$1.pid")" 2>/dev/null; }
healthy() { "$BIN/python" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2).read() != b'true')" 2>/dev/null; }
start() {  # name, command...: run in its own session (process group) so `make stop` can stop all of it
  local name=$1; shift
  setsid nohup "$@" >"$PREFECT_HOME/$name.log" 2>&1 </dev/null &
  echo $! >"$PREFECT_HOME/$name.pid"
}

if running server; then
  echo "serve: server already running (pid $(cat "$PREFECT_HOME/server.pid"))"
elif healthy; then
  echo "serve: something not started by 'make serve' already answers on $PREFECT_API_URL; stop it or set SHIFTLAB_PREFECT_PORT" >&2
  exit 1
else
  start server prefect server start --host "$BIND" --port "$PORT"
  echo "serve: starting Prefect server (pid $(cat "$PREFECT_HOME/server.pid"), log .prefect/server.log)"
fi
for ((i = 0; i < ${SHIFTLAB_SERVE_TIMEOUT:-180}; i++)); do
  healthy && break
  running server || { echo "serve: the server exited; see .prefect/server.log" >&2; tail -n 20 "$PREFECT_HOME/server.log" >&2; exit 1; }
  sleep 1
done
healthy || { echo "serve: no answer from $PREFECT_API_URL/health" >&2; exit 1; }

prefect work-pool inspect "$POOL" >/dev/null 2>&1 || prefect work-pool create "$POOL" --type process >/dev/null
prefect work-pool set-concurrency-limit "$POOL" "${SHIFTLAB_POOL_CONCURRENCY:-1}" >/dev/null
prefect --no-prompt deploy --all >"$PREFECT_HOME/deploy.log" 2>&1 || { cat "$PREFECT_HOME/deploy.log" >&2; exit 1; }

if running worker; then
  echo "serve: worker already running (pid $(cat "$PREFECT_HOME/worker.pid"))"
else
  start worker prefect worker start --pool "$POOL" --type process --name "shiftlab-$(hostname)"
  echo "serve: started worker on pool '$POOL' (pid $(cat "$PREFECT_HOME/worker.pid"), log .prefect/worker.log)"
fi
prefect deployment ls
cat <<MSG
serve: Prefect UI at http://$HOST:$PORT  (deployments: shiftlab-pipeline/nightly, shiftlab-sweep/grid)
  trigger a run:  PREFECT_API_URL=$PREFECT_API_URL .venv/bin/prefect deployment run shiftlab-pipeline/nightly
  stop it all:    make stop
MSG
