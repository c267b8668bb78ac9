#!/usr/bin/env bash
# A real 3-node Ray cluster on this one machine, for the ray backend's tests and benchmarks/ray.py: a head
# and two workers, each started by `ray start` in a network namespace of its own (its own address) on a
# private bridge, each offering a custom resource named after it so that placement is visible.
#
#   bash .ci/ray-setup.sh [up]          start what is not running (idempotent)
#   bash .ci/ray-setup.sh kill NODE     a node dies: every process of it SIGKILLed at once
#   bash .ci/ray-setup.sh teardown      stop and remove all of it (processes, namespaces, bridge, rule, files)
#
# Where things are (read by tests and benchmarks from $ROOT/ray.json):
#   bridge es-ray0 at $SUBNET.1/24 (the host); nodes head ($SUBNET.10), w1 ($SUBNET.11), w2 ($SUBNET.12);
#   the cluster's address $SUBNET.10:6379, its Ray Client server ray://$SUBNET.10:10001.
#   ENVSCALER_RAY_SUBNET (default 100.78.0) picks another /24.
# ENVSCALER_PYTHON names the interpreter whose `ray` runs the nodes (default: .venv/bin/python).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=/run/envscaler-ray
SUBNET="${ENVSCALER_RAY_SUBNET:-100.78.0}"
BRIDGE=es-ray0
HOST_IP="$SUBNET.1"
PYTHON="${ENVSCALER_PYTHON:-.venv/bin/python}"
RAY="$(cd "$(dirname "$PYTHON")" && pwd)/ray"
NODES=(head w1 w2)
HEAD_ADDRESS="$SUBNET.10:6379"
# Logical CPUs each node offers: more than this machine's cores, as servers mostly wait.
NODE_CPUS=4
OBJECT_STORE_BYTES=$((100 * 1024 * 1024))
# A private bridge, and the same for every node whatever ~/.ray holds (Ray turns token authentication on
# for a head when a token file exists there, and a worker started without it cannot join).
export RAY_AUTH_MODE=disabled

# shellcheck source=bridge.sh
source .ci/bridge.sh

say() { echo "ray-setup: $*" >&2; }

address_of() {
    case "$1" in
        head) echo "$SUBNET.10" ;;
        w1) echo "$SUBNET.11" ;;
        w2) echo "$SUBNET.12" ;;
        *) say "no node $1 (nodes: ${NODES[*]})"; exit 2 ;;
    esac
}

namespace_of() { echo "esray-$1"; }

namespace_up() {
    local node="$1" ns
    ns="$(namespace_of "$node")"
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns"
    fi
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        ip link delete "$ns-h" 2>/dev/null || true  # the end of a pair whose namespace is going
        ip link add "$ns-h" type veth peer name eth0 netns "$ns"
        ip link set "$ns-h" master "$BRIDGE" up
        ip -n "$ns" addr add "$(address_of "$node")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add default via "$HOST_IP"
    fi
}

node_running() {
    local pid_file="$ROOT/$1.pid"
    [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null
}

node_up() {
    local node="$1" ns address role
    ns="$(namespace_of "$node")"
    address="$(address_of "$node")"
    if node_running "$node"; then
        return
    fi
    namespace_up "$node"
    if [ "$node" = head ]; then
        role=(--head --port 6379 --ray-client-server-port 10001 --include-dashboard=false)
    else
        role=(--address "$HEAD_ADDRESS")
    fi
    say "starting node $node at $address"
    # --block keeps `ray start` in the foreground as the node's supervisor: its process group is the node.
    ip netns exec "$ns" setsid "$RAY" start "${role[@]}" --node-ip-address "$address" --num-cpus "$NODE_CPUS" \
        --resources "{\"node_$node\": 1}" --object-store-memory "$OBJECT_STORE_BYTES" --disable-usage-stats --block \
        >"$ROOT/$node.log" 2>&1 &
    echo $! >"$ROOT/$node.pid"
    for _ in $(seq 1 120); do
        if grep -q "Ray runtime started" "$ROOT/$node.log"; then
            return
        fi
        if ! node_running "$node"; then
            say "node $node did not start:"
            tail -20 "$ROOT/$node.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    say "node $node did not start within 60 s:"
    tail -20 "$ROOT/$node.log" >&2
    exit 1
}

wait_for_nodes() {
    for _ in $(seq 1 120); do
        if "$PYTHON" - "$HEAD_ADDRESS" "${#NODES[@]}" <<'EOF' 2>/dev/null; then
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
sys.exit(0 if sum(node["Alive"] for node in ray.nodes()) >= int(sys.argv[2]) else 1)
EOF
            return
        fi
        sleep 0.5
    done
    say "the cluster did not show ${#NODES[@]} live nodes within 60 s"
    exit 1
}

describe() {
    "$PYTHON" - "$ROOT/ray.json" "$HEAD_ADDRESS" "$SUBNET" <<'EOF'
import json, sys
path, head, subnet = sys.argv[1:]
nodes = {name: {"address": f"{subnet}.{10 + i}", "namespace": f"esray-{name}", "resource": f"node_{name}"}
         for i, name in enumerate(["head", "w1", "w2"])}
client = "ray://" + head.rsplit(":", 1)[0] + ":10001"
json.dump({"address": head, "client": client, "host": f"{subnet}.1", "nodes": nodes}, open(path, "w"), indent=2)
EOF
}

kill_node() {
    local node="$1" ns pids
    ns="$(namespace_of "$node")"
    address_of "$node" >/dev/null
    # Everything in the node's namespace: `ray start`, the raylet, its workers and what they started.
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    if [ -n "$pids" ]; then
        kill -9 $pids 2>/dev/null || true
    fi
    # Gone, not only signalled: a namespace deleted before its last process exits lingers with its veth.
    for _ in $(seq 1 100); do
        [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && break
        sleep 0.1
    done
    rm -f "$ROOT/$node.pid"
    say "killed node $node"
}

up() {
    command -v ip >/dev/null 2>&1 || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; }
    mkdir -p "$ROOT"
    bridge_up
    for node in "${NODES[@]}"; do
        node_up "$node"
    done
    wait_for_nodes
    describe
    say "3-node Ray cluster at $HEAD_ADDRESS (description in $ROOT/ray.json)"
}

teardown() {
    for node in "${NODES[@]}"; do
        kill_node "$node" 2>/dev/null || true
        # The pair goes now: a namespace outlives its name while TIME_WAIT sockets hold it.
        ip link delete "$(namespace_of "$node")-h" 2>/dev/null || true
        ip netns delete "$(namespace_of "$node")" 2>/dev/null || true
    done
    ip link delete "$BRIDGE" 2>/dev/null || true
    iptables -w -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null || true
    rm -rf "$ROOT"
}

case "${1:-up}" in
    up) up ;;
    kill) kill_node "${2:?name a node: ${NODES[*]}}" ;;
    teardown) teardown ;;
    *) say "usage: $0 [up|kill NODE|teardown]"; exit 2 ;;
esac
