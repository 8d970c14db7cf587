#!/usr/bin/env bash
# One line about this node for scripts/slurm/ray_on_slurm.sbatch, run on the host (outside any container) by one
# `srun` task per node before Ray starts:
#
#   probe <node> <driver version|none> <IPv4|none> <interface|none> <readable|unreadable|unchecked>
#
# The address is the first IPv4 of PROBE_INTERFACE when it is set (RAY_NETWORK_INTERFACE of the sbatch), else the
# first non-loopback IPv4 of `hostname --ip-address` (a loopback one only when nothing else is there, so the caller
# can reject it by name); the interface is the one that holds the address. The last field says whether this node
# can read the job's Ray token file PROBE_TOKEN_PATH (never its content). The sbatch decides what is acceptable.
set -uo pipefail

node=${SLURMD_NODENAME:-$(hostname -s)}
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')

# `ip -4 -o addr show` lines: "<n>: <iface>    inet <a.b.c.d>/<prefix> ...".
ipv4_of_interface() {
    ip -4 -o addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}'
}
interface_of_ipv4() {
    ip -4 -o addr show 2>/dev/null | awk -v want="$1" '{split($4, a, "/"); if (a[1] == want) {print $2; exit}}'
}

if [[ -n "${PROBE_INTERFACE:-}" ]]; then
    iface=${PROBE_INTERFACE}
    addr=$(ipv4_of_interface "${iface}")
else
    mapfile -t candidates < <(hostname --ip-address 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+(\.[0-9]+){3}$')
    addr=""
    for candidate in ${candidates[@]+"${candidates[@]}"}; do
        if [[ "${candidate}" != 127.* ]]; then
            addr=${candidate}
            break
        fi
    done
    if [[ -z "${addr}" && ${#candidates[@]} -gt 0 ]]; then
        addr=${candidates[0]}
    fi
    iface=""
    if [[ -n "${addr}" ]]; then
        iface=$(interface_of_ipv4 "${addr}")
    fi
fi
# A node without the shared folder has no file there (or an empty one while its copy is not yet visible).
token=unchecked
if [[ -n "${PROBE_TOKEN_PATH:-}" ]]; then
    token=unreadable
    if [[ -f "${PROBE_TOKEN_PATH}" && -r "${PROBE_TOKEN_PATH}" && -s "${PROBE_TOKEN_PATH}" ]]; then
        token=readable
    fi
fi
echo "probe ${node} ${driver:-none} ${addr:-none} ${iface:-none} ${token}"
