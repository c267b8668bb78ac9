# Sourced by .ci/swarm-setup.sh and .ci/ray-setup.sh: the private bridge their nodes' namespaces hang on.

# bridge_up: make $BRIDGE exist, up, with the host's address $HOST_IP/24 on it.
bridge_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$HOST_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # A host running dockerd has the FORWARD policy DROP, and bridged frames pass through it
    # (br_netfilter): traffic between the nodes (swarm control, gossip, VXLAN; Ray's) must be let through.
    if command -v iptables >/dev/null 2>&1; then
        iptables -w -C FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null ||
            iptables -w -I FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT
    fi
}
