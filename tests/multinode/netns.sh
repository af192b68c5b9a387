#!/usr/bin/env bash
# Two network namespaces joined by a veth pair, for two-"node" tests on one machine.
#   netns.sh up NAME_A NAME_B ADDR_A ADDR_B   (addresses in a private /24, e.g. 10.250.0.1 10.250.0.2)
#   netns.sh down NAME_A NAME_B
# Traffic stays between the two namespaces: no routes, no bridge to the host.
set -euo pipefail
cmd=$1; a=$2; b=$3
case "$cmd" in
  up)
    ip netns add "$a"
    ip netns add "$b"
    ip link add "${a}v" netns "$a" type veth peer name "${b}v" netns "$b"
    ip -n "$a" addr add "$4/24" dev "${a}v"
    ip -n "$b" addr add "$5/24" dev "${b}v"
    for ns in "$a" "$b"; do
      ip -n "$ns" link set lo up
    done
    ip -n "$a" link set "${a}v" up
    ip -n "$b" link set "${b}v" up
    ;;
  down)
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
    ;;
  *) echo "usage: $0 up|down NAME_A NAME_B [ADDR_A ADDR_B]" >&2; exit 2 ;;
esac
