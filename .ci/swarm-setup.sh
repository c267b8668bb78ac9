#!/usr/bin/env bash
# A real Docker Swarm on this one machine, for the swarm tests and benchmarks/swarm.py: one manager and
# two workers, each its own dockerd in its own network namespace (own address, data root, exec root,
# socket, hostname and cgroup parent), on a private bridge, plus a registry from Debian's
# docker-registry package that every node pulls from. The host's own dockerd is not touched.
#
#   bash .ci/swarm-setup.sh [up]          make all of it run (idempotent: skips what runs already)
#   bash .ci/swarm-setup.sh kill NODE     a node dies: off the network, every process of it SIGKILLed
#   bash .ci/swarm-setup.sh teardown      stop and remove all of it (namespaces, bridge, rule, data)
#
# Where things are (read by tests and benchmarks from $ROOT/swarm.json):
#   bridge es-swarm0 at $SUBNET.1/24 (the host), registry $SUBNET.1:5000,
#   nodes mgr ($SUBNET.10), w1 ($SUBNET.11), w2 ($SUBNET.12): DOCKER_HOST=unix:///run/envscaler-swarm/NODE/docker.sock
# ENVSCALER_SWARM_SUBNET (default 100.77.0) picks another /24 for the bridge when that one is taken.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=/run/envscaler-swarm
DATA=/var/lib/envscaler-swarm
SUBNET="${ENVSCALER_SWARM_SUBNET:-100.77.0}"
BRIDGE=es-swarm0
HOST_IP="$SUBNET.1"
REGISTRY="$HOST_IP:5000"
NODES=(mgr w1 w2)

# shellcheck source=bridge.sh
source .ci/bridge.sh

say() { echo "swarm-setup: $*" >&2; }

address_of() {
    case "$1" in
        mgr) echo "$SUBNET.10" ;;
        w1) echo "$SUBNET.11" ;;
        w2) echo "$SUBNET.12" ;;
        *) say "no node $1 (nodes: ${NODES[*]})"; exit 2 ;;
    esac
}

node_docker() { local node="$1"; shift; docker -H "unix://$ROOT/$node/docker.sock" "$@"; }
node_answers() { node_docker "$1" info >/dev/null 2>&1; }

install_packages() {
    if ! command -v docker-registry >/dev/null 2>&1 || ! command -v unshare >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
        say "installing docker-registry, iproute2 and util-linux"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry iproute2 util-linux >/dev/null
    fi
}

registry_up() {
    if curl -fsS -m 2 "http://$REGISTRY/v2/" >/dev/null 2>&1; then
        return
    fi
    say "starting the registry on $REGISTRY"
    mkdir -p "$DATA/registry" "$ROOT"
    cat >"$DATA/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $DATA/registry
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
    setsid nohup docker-registry serve "$DATA/registry.yml" >/var/log/envscaler-swarm-registry.log 2>&1 </dev/null &
    echo $! >"$ROOT/registry.pid"
    for _ in $(seq 1 50); do
        curl -fsS -m 2 "http://$REGISTRY/v2/" >/dev/null 2>&1 && return
        sleep 0.2
    done
    say "the registry did not answer; see /var/log/envscaler-swarm-registry.log"
    exit 1
}

node_up() {
    local node="$1" address ns="es-swarm-$1" veth="es-sw-$1"
    address="$(address_of "$node")"
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE"
    fi
    ip link set "$veth" up
    ip -n "$ns" addr replace "$address/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    node_answers "$node" && return
    say "starting dockerd of $node at $address"
    mkdir -p "$ROOT/$node" "$DATA/$node"
    cat >"$DATA/$node/daemon.json" <<EOF
{
  "data-root": "$DATA/$node/docker",
  "exec-root": "$ROOT/$node/exec",
  "pidfile": "$ROOT/$node/dockerd.pid",
  "hosts": ["unix://$ROOT/$node/docker.sock"],
  "insecure-registries": ["$REGISTRY"],
  "cgroup-parent": "/es-swarm-$node",
  "labels": ["envscaler.swarm.node=$node"],
  "log-level": "warn"
}
EOF
    # Its own mount namespace (a fresh /sys that shows the node's interfaces, with the host's cgroup
    # hierarchies bound back under it) and hostname, in the node's network namespace. Mounts made
    # there (images, containers' namespaces) vanish with the node's processes.
    setsid nohup nsenter --net="/run/netns/$ns" unshare --mount --uts --propagation slave sh -c "
        set -e
        hostname $ns
        mkdir -p $ROOT/$node/cgroup
        mount --rbind /sys/fs/cgroup $ROOT/$node/cgroup
        mount -t sysfs sysfs /sys
        mount --rbind $ROOT/$node/cgroup /sys/fs/cgroup
        umount -l $ROOT/$node/cgroup
        exec dockerd --config-file $DATA/$node/daemon.json
    " >"/var/log/envscaler-swarm-$node.log" 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        node_answers "$node" && return
        sleep 0.5
    done
    say "dockerd of $node did not answer within 60 s; see /var/log/envscaler-swarm-$node.log"
    exit 1
}

swarm_up() {
    local manager_address state token node
    manager_address="$(address_of mgr)"
    state="$(node_docker mgr info --format '{{.Swarm.LocalNodeState}}')"
    if [ "$state" != "active" ]; then
        say "docker swarm init on mgr"
        node_docker mgr swarm init --advertise-addr "$manager_address" --listen-addr "$manager_address:2377" >/dev/null
    fi
    token="$(node_docker mgr swarm join-token -q worker)"
    for node in "${NODES[@]:1}"; do
        state="$(node_docker "$node" info --format '{{.Swarm.LocalNodeState}}')"
        if [ "$state" != "active" ] && [ "$state" != "pending" ]; then
            say "docker swarm join on $node"
            node_docker "$node" swarm join --token "$token" --advertise-addr "$(address_of "$node")" "$manager_address:2377" >/dev/null
        fi
    done
    # A node rebuilt from scratch joins as a new node: forget the old entries of it that are down.
    for id in $(node_docker mgr node ls --filter role=worker --format '{{.ID}} {{.Status}}' | awk '$2 == "Down" {print $1}'); do
        node_docker mgr node rm --force "$id" >/dev/null 2>&1 || true
    done
    for _ in $(seq 1 60); do
        [ "$(node_docker mgr node ls --format '{{.Status}}' | grep -c Ready)" -ge "${#NODES[@]}" ] && return
        sleep 0.5
    done
    say "not every node is Ready:"
    node_docker mgr node ls >&2
    exit 1
}

seed_images() {
    # The manager builds the farm's images (envscaler build on DOCKER_HOST), as a real one would after
    # pulling python:3.11-slim: it gets the base image the host's docker-setup made, and the runtime
    # image built there from this code (so the first farm up need not build it again).
    local base found="" image tags
    for base in python:3.11-slim envscaler-base:bookworm; do
        if docker image inspect "$base" >/dev/null 2>&1; then
            found="$base"
            break
        fi
    done
    [ -n "$found" ] || { say "no base image on the host (python:3.11-slim or envscaler-base:bookworm): run .ci/docker-setup.sh first"; exit 1; }
    for image in "$found" envscaler-runtime:latest; do
        docker image inspect "$image" >/dev/null 2>&1 || continue
        if [ "$(node_docker mgr image inspect --format '{{.Id}}' "$image" 2>/dev/null)" != "$(docker image inspect --format '{{.Id}}' "$image")" ]; then
            tags="$(docker image inspect --format '{{join .RepoTags " "}}' "$image")"
            say "loading $tags into the manager"
            # shellcheck disable=SC2086 # one argument per tag
            docker save $tags | node_docker mgr load -q >/dev/null
        fi
    done
}

write_description() {
    local node first=1
    {
        echo "{"
        echo "  \"registry\": \"$REGISTRY\","
        echo "  \"manager\": \"unix://$ROOT/mgr/docker.sock\","
        echo "  \"nodes\": {"
        for node in "${NODES[@]}"; do
            [ $first -eq 1 ] || echo ","
            first=0
            printf '    "%s": {"docker_host": "unix://%s/%s/docker.sock", "address": "%s", "hostname": "es-swarm-%s"}' \
                "$node" "$ROOT" "$node" "$(address_of "$node")" "$node"
        done
        echo
        echo "  }"
        echo "}"
    } >"$ROOT/swarm.json"
}

kill_node() {
    local node="$1" pid cgroup
    address_of "$node" >/dev/null
    # Off the network first, as with a pulled cable: peers see silence, not refused connections.
    ip link set "es-sw-$node" down 2>/dev/null || true
    for cgroup in /sys/fs/cgroup/pids/es-swarm-"$node"; do
        [ -d "$cgroup" ] || continue
        find "$cgroup" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    done
    # dockerd, its containerd and the shims: every process whose command line names this node's folders.
    for pid in $(grep -l -s -a -F -e "$ROOT/$node/" -e "$DATA/$node/" /proc/[0-9]*/cmdline | cut -d/ -f3); do
        [ "$pid" != "$$" ] && kill -9 "$pid" 2>/dev/null || true
    done
    for _ in $(seq 1 50); do
        grep -q -s -a -F -e "$ROOT/$node/" -e "$DATA/$node/" /proc/[0-9]*/cmdline || break
        sleep 0.1
    done
    # Killed processes may linger as zombies while their pids stay taken: a restarted dockerd must not
    # take a dead containerd's pid file for a live one.
    rm -f "$ROOT/$node/docker.sock" "$ROOT/$node/dockerd.pid" "$ROOT/$node/exec/containerd/containerd.pid"
}

teardown() {
    local node
    for node in "${NODES[@]}"; do
        kill_node "$node"
        ip link del "es-sw-$node" 2>/dev/null || true
        ip netns del "es-swarm-$node" 2>/dev/null || true
        for controller in /sys/fs/cgroup/*/es-swarm-"$node"; do
            [ -d "$controller" ] && find "$controller" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        done
    done
    if [ -f "$ROOT/registry.pid" ]; then
        kill "$(cat "$ROOT/registry.pid")" 2>/dev/null || true
    fi
    while iptables -w -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null; do :; done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$ROOT" "$DATA"
    say "removed"
}

up() {
    local started=$SECONDS node
    command -v docker >/dev/null 2>&1 || { say "no docker client: run .ci/docker-setup.sh first"; exit 1; }
    install_packages
    mkdir -p "$ROOT" "$DATA"
    bridge_up
    registry_up
    for node in "${NODES[@]}"; do
        node_up "$node"
    done
    swarm_up
    seed_images
    write_description
    say "swarm of ${#NODES[@]} nodes ready in $((SECONDS - started)) s; registry $REGISTRY; manager DOCKER_HOST=unix://$ROOT/mgr/docker.sock"
}

case "${1:-up}" in
    up) up ;;
    kill) kill_node "${2:?usage: swarm-setup.sh kill NODE}" ;;
    teardown) teardown ;;
    *) say "usage: swarm-setup.sh [up | kill NODE | teardown]"; exit 2 ;;
esac
