#!/usr/bin/env bash
# A local Ray cluster (one head node) and an MLflow tracking server for development and tests.
# Everything listens on 127.0.0.1 only: the dashboard/job API, MLflow, and Ray's GCS, raylet,
# object manager and agent (infra/README.md says how Ray is kept there).
#
#   infra/local_cluster.sh start    start both, wait until both answer, print the submit command
#   infra/local_cluster.sh stop     stop both (safe to run again, or when nothing runs)
#   infra/local_cluster.sh status   say what runs; exit 0 only if both answer
#   infra/local_cluster.sh env      print the shell lines that point `ray job submit` and MLflow here
#
# Settings (environment):
#   HR_STATE_DIR        pids, logs, Ray temp dir, MLflow database and artifacts
#                       (default ${TMPDIR:-/tmp}/hybrid-ray-local-$UID; keep it short: Ray puts
#                       unix sockets under it and those paths are limited to ~107 bytes)
#   HR_RAY_PORT         Ray GCS port (6379)            HR_DASHBOARD_PORT  dashboard + job API (8265)
#   HR_AGENT_PORT       dashboard agent HTTP (52365)   HR_MLFLOW_PORT     MLflow server (5000)
#   HR_CLIENT_PORT      Ray client server (10001; only started when grpcio, ray[client], is installed)
#   HR_NUM_CPUS         CPUs Ray offers (detected)
#   HR_START_TIMEOUT    seconds to wait for each service to answer (90)
#   HR_BIN              directory holding `ray` and `mlflow` (the repo's .venv/bin when present)
#   RAY_AUTH_MODE       disabled (default here) or token. Always passed to `ray start` explicitly:
#                       when it is unset, Ray >= 2.52 turns token auth on by itself as soon as
#                       ~/.ray/auth_token exists (any earlier `ray.init()` writes one), and a
#                       `ray job submit` without the token then gets 401.
#                       With token: the token is RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH,
#                       else a new one written to $HR_STATE_DIR/auth_token (never to ~/.ray).
#
# Processes are stopped by the sessions this script created (setsid), never with `ray stop`:
# that would also kill every other Ray cluster on the machine.
set -euo pipefail +m

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${HR_STATE_DIR:-${TMPDIR:-/tmp}/hybrid-ray-local-$(id -u)}
RAY_PORT=${HR_RAY_PORT:-6379}
DASHBOARD_PORT=${HR_DASHBOARD_PORT:-8265}
CLIENT_PORT=${HR_CLIENT_PORT:-}
AGENT_PORT=${HR_AGENT_PORT:-52365}
MLFLOW_PORT=${HR_MLFLOW_PORT:-5000}
START_TIMEOUT=${HR_START_TIMEOUT:-90}
STOP_TIMEOUT=${HR_STOP_TIMEOUT:-20}
AUTH_MODE=${RAY_AUTH_MODE:-disabled}
HOST=127.0.0.1

if [ -n "${HR_BIN:-}" ]; then BIN=$HR_BIN/
elif [ -x "$REPO/.venv/bin/ray" ]; then BIN=$REPO/.venv/bin/
else BIN=""; fi
PY=${BIN:+${BIN}python}; PY=${PY:-python3}

die() { echo "local_cluster: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }

# --- process sessions -----------------------------------------------------------------------
# Each service runs in its own session (setsid), and stop signals exactly the processes of that
# session. A session rather than a process group: the raylet moves each Ray worker into its own
# process group, but not out of the session.
read_sid() { [ -f "$STATE/$1.sid" ] && cat "$STATE/$1.sid" || true; }
# Live (non-zombie) processes of session $1.
members() { ps -eo pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ {print $1}'; }
session_alive() { [ -n "$1" ] && [ -n "$(members "$1")" ]; }

# Starts "$@" as the leader of a new session, its output in $STATE/<name>.log, and records the
# session id in $STATE/<name>.sid. Job control is off (set +m), so the background child is not a
# group leader and `setsid` calls setsid() in place: session id == $!.
spawn() {
  local name=$1; shift
  setsid "$@" >"$STATE/$name.log" 2>&1 </dev/null &
  local pid=$! i
  for i in $(seq 50); do
    [ "$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ] && break
    kill -0 "$pid" 2>/dev/null || break       # exited at once: wait_for reports it
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null && [ "$(ps -o sid= -p "$pid" | tr -d ' ')" != "$pid" ]; then
    die "could not start $name in a session of its own (is job control on?)"
  fi
  echo "$pid" >"$STATE/$name.sid"
}

# Stops every process of the session: SIGTERM to the leader first (`ray start --block` then
# drains the node and stops its own processes in order, in ~3 s; signalling all of them at once
# makes it wait out a 30 s drain timeout), then SIGTERM to whatever is left, then SIGKILL.
# Quiet and successful when nothing runs; refuses to touch this script's own session.
alive() { ps -o stat= -p "$1" 2>/dev/null | grep -qv '^Z'; }
wait_until_gone() {   # $1: "leader" or "session", $2: sid, $3: seconds
  local i=0
  while [ "$i" -lt $(($3 * 5)) ]; do
    if [ "$1" = leader ]; then alive "$2" || return 0; else session_alive "$2" || return 0; fi
    sleep 0.2; i=$((i + 1))
  done
  return 1
}
stop_session() {
  local name=$1 sid how start=$SECONDS
  sid=$(read_sid "$name")
  if [ -n "$sid" ] && [ "$sid" = "$(ps -o sid= -p $$ | tr -d ' ')" ]; then
    die "refusing to stop session $sid: it is this shell's own"
  fi
  if session_alive "$sid"; then
    how="SIGTERM to its leader"
    { alive "$sid" && kill -TERM "$sid" 2>/dev/null && wait_until_gone leader "$sid" "$STOP_TIMEOUT"; } || true
    if session_alive "$sid"; then
      how="SIGTERM"
      # shellcheck disable=SC2046
      kill -TERM $(members "$sid") 2>/dev/null || true
      if ! wait_until_gone session "$sid" 5; then
        how="SIGKILL (still running after SIGTERM: $(members "$sid" | tr '\n' ' '))"
        # shellcheck disable=SC2046
        kill -KILL $(members "$sid") 2>/dev/null || true
        wait_until_gone session "$sid" 5 || die "$name (session $sid) did not exit: $(members "$sid" | tr '\n' ' ')"
      fi
    fi
    say "stopped $name (session $sid) by $how in $((SECONDS - start))s"
  fi
  rm -f "$STATE/$name.sid"
}

# --- health checks --------------------------------------------------------------------------
port_in_use() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

auth_header() {
  if [ "$AUTH_MODE" = token ]; then
    local tok=${RAY_AUTH_TOKEN:-}
    [ -n "$tok" ] || tok=$(cat "$RAY_AUTH_TOKEN_PATH")
    printf 'Authorization: Bearer %s' "$tok"
  else
    printf 'X-Ray-Local-Cluster: 1'   # a harmless header so curl always gets one -H argument
  fi
}

# The job API answers (GET /api/jobs/ is what `ray job list` calls) with our auth settings, and
# so does GET /api/version, the first thing `ray job submit` reads: in one soak run the jobs
# route answered while the version request got a 200 whose body was not JSON, and the README's
# submit right after start failed with JSONDecodeError.
ray_answers() {
  local version
  curl -sf -m 3 -o /dev/null -H "$(auth_header)" "http://$HOST:$DASHBOARD_PORT/api/jobs/" &&
    version=$(curl -sf -m 3 -H "$(auth_header)" "http://$HOST:$DASHBOARD_PORT/api/version") &&
    [[ $version == *'"ray_version"'* ]]
}
mlflow_answers() { curl -sf -m 3 "http://$HOST:$MLFLOW_PORT/health" 2>/dev/null | grep -q OK; }

# Waits until "$2" succeeds; fails early when the session of service $1 has died. On failure
# sets REASON to one line: what happened and the last line of the service's log.
REASON=""
wait_for() {
  local name=$1 check=$2 deadline=$((SECONDS + START_TIMEOUT)) last
  while ! "$check"; do
    if ! session_alive "$(read_sid "$name")"; then REASON="exited during start-up"; break; fi
    if [ "$SECONDS" -ge "$deadline" ]; then REASON="did not answer within ${START_TIMEOUT}s"; break; fi
    sleep 0.5
  done
  [ -z "$REASON" ] && return 0
  last=$(sed 's/\x1b\[[0-9;]*m//g' "$STATE/$name.log" 2>/dev/null | grep -v '^[[:space:]]*$' \
    | tail -n 1 | cut -c1-200 || true)
  REASON="$REASON: ${last:-empty log} (log: $STATE/$name.log)"
  return 1
}

# --- auth -----------------------------------------------------------------------------------
setup_auth() {
  case "$AUTH_MODE" in
    disabled) unset RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH ;;
    token)
      if [ -z "${RAY_AUTH_TOKEN:-}" ]; then
        if [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then
          RAY_AUTH_TOKEN_PATH=$STATE/auth_token
          if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
            # 256 random bits as 64 hex digits, the form `ray get-auth-token --generate` writes.
            (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
          fi
        fi
        [ -s "$RAY_AUTH_TOKEN_PATH" ] || die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty"
        export RAY_AUTH_TOKEN_PATH
      fi ;;
    *) die "RAY_AUTH_MODE must be 'disabled' or 'token', not '$AUTH_MODE'" ;;
  esac
  export RAY_AUTH_MODE=$AUTH_MODE
}

# Shell lines that make `ray job submit`, `ray job logs` and MLflow clients use this cluster,
# and put the project's `ray`, `mlflow` and `python` first on PATH (nothing else to activate).
env_lines() {
  [ -n "$BIN" ] && echo "export PATH=\"${BIN%/}:\$PATH\""
  echo "export RAY_ADDRESS=http://$HOST:$DASHBOARD_PORT"
  echo "export RAY_AUTH_MODE=$AUTH_MODE"
  if [ "$AUTH_MODE" = token ]; then
    if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then echo "export RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"
    else echo "# RAY_AUTH_TOKEN: use the same value as when the cluster was started"; fi
  fi
  echo "export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT"
}

print_usage_hint() {
  say "ray dashboard and job API: http://$HOST:$DASHBOARD_PORT (GCS port $RAY_PORT, auth $AUTH_MODE)"
  say "mlflow: http://$HOST:$MLFLOW_PORT (store $STATE/mlflow.db)"
  echo "Submit the main job from the repository (the environment lines are in $STATE/env):"
  echo "  eval \"\$(infra/local_cluster.sh env)\""
  echo "  ray job submit --working-dir . -- python jobs/train_lm.py --config jobs/configs/small_cpu.json \\"
  echo "    --min-workers 1 --max-workers 2 --storage \"\$PWD/runs\" --steps 100"
  echo "Stop: infra/local_cluster.sh stop   (with the same HR_STATE_DIR)"
}

# --- commands -------------------------------------------------------------------------------
cmd_start() {
  mkdir -p "$STATE"
  local ray_sid mlflow_sid
  ray_sid=$(read_sid ray); mlflow_sid=$(read_sid mlflow)
  if session_alive "$ray_sid" || session_alive "$mlflow_sid"; then
    # shellcheck source=/dev/null
    [ -f "$STATE/env" ] && . "$STATE/env"   # the running cluster's auth settings
    AUTH_MODE=${RAY_AUTH_MODE:-$AUTH_MODE}
    if session_alive "$ray_sid" && session_alive "$mlflow_sid" && ray_answers && mlflow_answers; then
      say "already running"; print_usage_hint; return 0
    fi
    die "a previous start in $STATE is partly running; run 'infra/local_cluster.sh stop' first"
  fi
  command -v "${BIN}ray" >/dev/null || die "ray not found (set HR_BIN or run infra/setup.sh)"
  command -v "${BIN}mlflow" >/dev/null || die "mlflow not found (set HR_BIN or run infra/setup.sh)"
  command -v curl >/dev/null || die "curl not found"
  # Ray's optional parts decide what `ray start` runs: without the dashboard packages
  # (ray[default]) there is no job API; with grpcio (ray[client]) a client server takes port 10001.
  local extras
  extras=$("$PY" -c 'from ray._private.utils import get_dashboard_dependency_error as d, get_ray_client_dependency_error as c
print("dashboard-missing" if d() else "dashboard-ok", "client-missing" if c() else "client-ok")' 2>/dev/null) \
    || die "cannot import ray with $PY (set HR_BIN or run infra/setup.sh)"
  case "$extras" in dashboard-missing*)
    die "Ray's dashboard and job API packages are missing: pip install 'ray[default]==$("$PY" -c 'import ray; print(ray.__version__)')'" ;;
  esac
  case "$extras" in
    *client-ok) CLIENT_PORT=${CLIENT_PORT:-10001} ;;
    *) [ -z "$CLIENT_PORT" ] || die "HR_CLIENT_PORT is set but Ray client (ray[client]) is not installed"; CLIENT_PORT="" ;;
  esac
  local var port
  for var in HR_RAY_PORT:$RAY_PORT HR_DASHBOARD_PORT:$DASHBOARD_PORT HR_CLIENT_PORT:$CLIENT_PORT \
             HR_AGENT_PORT:$AGENT_PORT HR_MLFLOW_PORT:$MLFLOW_PORT; do
    port=${var#*:}
    [ -n "$port" ] || continue
    port_in_use "$port" && die "port $port (${var%%:*}) on $HOST is already in use"
  done
  setup_auth
  env_lines >"$STATE/env"
  export RAY_USAGE_STATS_ENABLED=0
  # MLflow's server-side job runner (GenAI scorers) is not used here; it adds ~8 processes.
  export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
  # Jobs inherit the raylet's environment, so they find MLflow without being told, and a job's
  # `python` is the project's (torch, Ray, hybrid_ray) whatever the submitting shell has on PATH.
  export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
  if [ -n "$BIN" ]; then
    export PATH="${BIN%/}:$PATH"
    [ -f "${BIN}activate" ] && export VIRTUAL_ENV=$(cd "$BIN/.." && pwd)
  fi
  # Without it Ray swaps --node-ip-address 127.0.0.1 for the host's outward address and its GCS,
  # raylet and agent listen on every interface; with it the node, its ports and every job's
  # driver and workers stay on loopback (jobs inherit it like PATH above).
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
  mkdir -p "$STATE/mlartifacts"

  local ray_args=(start --head --block --node-ip-address "$HOST" --port "$RAY_PORT"
    --dashboard-host "$HOST" --dashboard-port "$DASHBOARD_PORT" --include-dashboard true
    --dashboard-agent-listen-port "$AGENT_PORT" --temp-dir "$STATE/ray" --disable-usage-stats)
  [ -n "$CLIENT_PORT" ] && ray_args+=(--ray-client-server-port "$CLIENT_PORT")
  [ -n "${HR_NUM_CPUS:-}" ] && ray_args+=(--num-cpus "$HR_NUM_CPUS")
  spawn ray "${BIN}ray" "${ray_args[@]}"
  spawn mlflow "${BIN}mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$STATE/mlflow.db" --artifacts-destination "$STATE/mlartifacts"

  local failed=""
  wait_for ray ray_answers || failed="ray head"
  [ -n "$failed" ] || wait_for mlflow mlflow_answers || failed="mlflow server"
  if [ -n "$failed" ]; then
    cmd_stop >/dev/null 2>&1 || true
    die "$failed did not come up, $REASON"
  fi
  say "started"
  print_usage_hint
}

cmd_stop() {
  [ -d "$STATE" ] || { say "nothing to stop ($STATE does not exist)"; return 0; }
  local had=""
  [ -n "$(read_sid ray)$(read_sid mlflow)" ] && had=1
  stop_session ray
  stop_session mlflow
  [ -n "$had" ] || say "nothing was running"
}

cmd_status() {
  # shellcheck source=/dev/null
  [ -f "$STATE/env" ] && . "$STATE/env"
  AUTH_MODE=${RAY_AUTH_MODE:-$AUTH_MODE}
  local ok=0
  if session_alive "$(read_sid ray)" && ray_answers; then say "ray: answering on http://$HOST:$DASHBOARD_PORT"
  else say "ray: not answering"; ok=1; fi
  if session_alive "$(read_sid mlflow)" && mlflow_answers; then say "mlflow: answering on http://$HOST:$MLFLOW_PORT"
  else say "mlflow: not answering"; ok=1; fi
  return $ok
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) if [ -f "$STATE/env" ]; then cat "$STATE/env"; else die "not started ($STATE/env missing)"; fi ;;
  *) echo "usage: $0 start|stop|status|env   (settings: see the top of this file)" >&2; exit 2 ;;
esac
