#!/usr/bin/env bash
# The 2-rank [distributed] cases across two "hosts": two network namespaces joined by a veth pair,
# a hostfile naming their addresses, OpenMPI's TCP transport, and a launcher that enters the other
# namespace with `ip netns exec` where a real cluster would ssh. Traffic stays on the veth pair:
# this is the path a user's second machine takes (README: "Across machines").
#
#   tests/distributed/two_hosts.sh <kiln_tests binary> [catch2 test spec]
# Needs root (namespaces) and iproute2; prints why and exits 0 ("skipped") where either is missing.
set -euo pipefail
binary=$1 spec=${2:-[distributed]}
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v mpirun >/dev/null; then
  echo "two_hosts: skipped (needs root, iproute2 and mpirun)"; exit 0
fi
tag=k$$
a=${tag}a b=${tag}b
work=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
if ! ip netns add "$a" 2>/dev/null; then
  echo "two_hosts: skipped (this machine does not allow network namespaces)"; exit 0
fi
ip netns add "$b"
ip link add "${tag}va" type veth peer name "${tag}vb"
ip link set "${tag}va" netns "$a"
ip link set "${tag}vb" netns "$b"
# A /24 from the documentation-free private range, unlikely to clash with the host's.
net=10.$((RANDOM % 200 + 20)).$((RANDOM % 250)).
ip -n "$a" addr add "${net}1/24" dev "${tag}va"
ip -n "$b" addr add "${net}2/24" dev "${tag}vb"
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
done
ip -n "$a" link set "${tag}va" up
ip -n "$b" link set "${tag}vb" up

# The "ssh" OpenMPI starts its daemon on each host with: the host's namespace, then the command.
cat >"$work/netns_ssh" <<SCRIPT
#!/bin/sh
host=\$1; shift
case "\$host" in
  ${net}1) ns=$a ;;
  ${net}2) ns=$b ;;
  *) echo "netns_ssh: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
SCRIPT
chmod +x "$work/netns_ssh"
printf '%s slots=1\n%s slots=1\n' "${net}1" "${net}2" >"$work/hosts"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# mpirun itself runs on the first host; both ranks start through the launcher, one per host.
ip netns exec "$a" mpirun -np 2 --hostfile "$work/hosts" --map-by node \
  --mca plm_rsh_agent "$work/netns_ssh" --mca plm_rsh_no_tree_spawn 1 \
  --mca btl tcp,self --mca btl_tcp_if_include "${net}0/24" --mca oob_tcp_if_include "${net}0/24" \
  -x KILN_CACHE_DIR -x KILN_COLLECTIVE_TIMEOUT -x PATH ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH} \
  "$binary" "$spec"
