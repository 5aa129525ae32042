#!/usr/bin/env bash
# `make stop`: stop what `make serve` started — the worker, then the server — by their pid files
# in .prefect/. Each was started in its own process group (session), so its children (uvicorn,
# flow-run processes) stop with it. A Prefect worker treats the first SIGTERM as "stop taking
# new runs" and the second as "kill now", so it gets two; a flow run still going is ended.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="$ROOT/.prefect"

wait_gone() {  # pid, seconds
  local i
  for ((i = 0; i < $2 * 4; i++)); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.25; done
  return 1
}
signal() { kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null; }

for name in worker server; do
  pidfile="$HOME_DIR/$name.pid"
  [[ -f "$pidfile" ]] || { echo "stop: no $name pid file (not started by 'make serve')"; continue; }
  pid="$(cat "$pidfile")"
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "stop: $name (pid $pid) was not running"
  else
    signal TERM "$pid"
    wait_gone "$pid" 5 || { signal TERM "$pid"; wait_gone "$pid" 5; } || { signal KILL "$pid"; wait_gone "$pid" 5; }
    if kill -0 "$pid" 2>/dev/null; then echo "stop: $name (pid $pid) is still running" >&2; exit 1; fi
    echo "stop: stopped $name (pid $pid)"
  fi
  rm -f "$pidfile"
done
