"""Alpha-beta time of each collective on a two-level cluster: GPUs inside a node over NVLink, nodes over a network.

Why here: the communication layer delays its collectives by these times when a run simulates a slower network
(`trainer.simulated_network`), and the scaling benchmark predicts step times with the same formulas.

`n` is always what `optim.comm.Comm` counts: the bytes one rank puts into the collective. With p ranks, g per
node and N = p / g nodes, a link of bandwidth B (bytes/s, one direction) and latency alpha per step costs:

    ring all-reduce          2 (p-1)/p * n / B + 2 (p-1) alpha
    reduce-scatter           (p-1)/p * n / B + (p-1) alpha
    ring all-gather          (p-1) * n / B + (p-1) alpha                 (n: each rank's input)
    all-reduce (two-level)   intra-node reduce-scatter of n over NVLink, then g concurrent rings over the N nodes,
                             one per local rank on its n/g shard (together n through each node's network link:
                             a ring all-reduce of n over N), then intra-node all-gather of the n/g shards
    all-gather (two-level)   g concurrent inter-node rings of n over N (g * n per step through the node's link),
                             then an intra-node all-gather of the N * n each rank holds
    all-to-all (two-level)   pairwise exchange: g (N-1)/N * n leaves a node over the network, (g-1)/p * n moves
                             over NVLink; one latency per peer: (p-g) network and (g-1) NVLink steps
    broadcast (two-level)    pipelined chain: n / B + (N-1) alpha across the nodes, n / B + (g-1) alpha inside them

With one node every formula is its single-link form over NVLink, and with one rank per node over the network.

Link figures (all NOMINAL signalling/data rates, not measured throughput; real collectives reach less):
  10gbe   10 Gb/s Ethernet, IEEE 802.3ae                          1.25 GB/s per direction
  25gbe   25 Gb/s Ethernet, IEEE 802.3by                          3.125 GB/s
  100gbe  100 Gb/s Ethernet, IEEE 802.3ba                         12.5 GB/s
  ib100   InfiniBand EDR 4x, 100 Gb/s data rate (IBTA)            12.5 GB/s
  ib200   InfiniBand HDR 4x, 200 Gb/s data rate (IBTA)            25 GB/s
  nvlink2 V100 NVLink2, 300 GB/s total both ways (NVIDIA V100 datasheet)       150 GB/s per direction
  nvlink3 A100 NVLink3, 600 GB/s total both ways (NVIDIA A100 datasheet)       300 GB/s per direction
Latencies (alpha, per ring step) are NCCL's own model figures for its ring algorithm with the Simple protocol
(NVIDIA/nccl, src/graph/tuning.cc, `hwLat`): 14 us over the network (NCCL uses one figure for InfiniBand and
Ethernet) and 3.4 us over NVLink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LINKS", "NETWORKS", "Cluster", "Link", "collective_seconds", "parse_cluster"]

_GBIT = 1e9 / 8  # bytes per second in one Gb/s
_NET_ALPHA = 14e-6  # NCCL tuning.cc hwLat[NET][Ring][Simple]
_NVLINK_ALPHA = 3.4e-6  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]


@dataclass(frozen=True)
class Link:
    """One direction of a link: nominal bandwidth in bytes/s and the latency of one collective step in s."""

    bandwidth: float
    latency: float


LINKS: dict[str, Link] = {
    "10gbe": Link(10 * _GBIT, _NET_ALPHA),
    "25gbe": Link(25 * _GBIT, _NET_ALPHA),
    "100gbe": Link(100 * _GBIT, _NET_ALPHA),
    "ib100": Link(100 * _GBIT, _NET_ALPHA),
    "ib200": Link(200 * _GBIT, _NET_ALPHA),
    "nvlink2": Link(150e9, _NVLINK_ALPHA),
    "nvlink3": Link(300e9, _NVLINK_ALPHA),
}
NETWORKS = ("10gbe", "25gbe", "100gbe", "ib100", "ib200")  # between nodes
NVLINKS = ("nvlink2", "nvlink3")  # inside a node


@dataclass(frozen=True)
class Cluster:
    """Nodes of `gpus_per_node` ranks joined by `network`, the ranks of a node by `nvlink`."""

    network: Link
    gpus_per_node: int = 1
    nvlink: Link = LINKS["nvlink3"]


CLUSTER_FORMAT = "NETWORK[:GPUS_PER_NODE[:NVLINK]]"


def parse_cluster(text: str) -> Cluster:
    """`ib100:8:nvlink3` -> Cluster; `10gbe` alone means one rank per node. Raises ValueError saying what is allowed."""
    parts = str(text).split(":")
    allowed = (f"must be {CLUSTER_FORMAT}, NETWORK one of {', '.join(NETWORKS)}, NVLINK one of "
               f"{', '.join(NVLINKS)} (e.g. 10gbe or ib100:8:nvlink3)")
    if not 1 <= len(parts) <= 3 or parts[0] not in NETWORKS:
        raise ValueError(allowed)
    gpus = parts[1] if len(parts) > 1 else "1"
    nvlink = parts[2] if len(parts) > 2 else "nvlink3"
    if not gpus.isdigit() or int(gpus) < 1 or nvlink not in NVLINKS:
        raise ValueError(allowed)
    return Cluster(LINKS[parts[0]], int(gpus), LINKS[nvlink])


def ring_all_reduce_seconds(n: float, p: int, link: Link) -> float:
    return 2 * (p - 1) / p * n / link.bandwidth + 2 * (p - 1) * link.latency


def reduce_scatter_seconds(n: float, p: int, link: Link) -> float:
    return (p - 1) / p * n / link.bandwidth + (p - 1) * link.latency


def ring_all_gather_seconds(n: float, p: int, link: Link) -> float:
    """Each of the p ranks contributes `n` bytes."""
    return (p - 1) * n / link.bandwidth + (p - 1) * link.latency


def _layout(p: int, cluster: Cluster) -> tuple[int, int]:
    """(ranks per node, nodes) of a world of p ranks; a world smaller than a node fills one node."""
    g = min(cluster.gpus_per_node, p)
    return g, math.ceil(p / g)


def all_reduce_seconds(n: float, p: int, cluster: Cluster) -> float:
    """Hierarchical: intra-node reduce-scatter, inter-node ring all-reduce, intra-node all-gather."""
    g, nodes = _layout(p, cluster)
    return (reduce_scatter_seconds(n, g, cluster.nvlink) + ring_all_reduce_seconds(n, nodes, cluster.network)
            + ring_all_gather_seconds(n / g, g, cluster.nvlink))


def all_gather_seconds(n: float, p: int, cluster: Cluster) -> float:
    g, nodes = _layout(p, cluster)
    return (ring_all_gather_seconds(g * n, nodes, cluster.network)
            + ring_all_gather_seconds(nodes * n, g, cluster.nvlink))


def all_to_all_seconds(n: float, p: int, cluster: Cluster) -> float:
    g, nodes = _layout(p, cluster)
    network = g * (nodes - 1) / nodes * n / cluster.network.bandwidth + (p - g) * cluster.network.latency
    return network + (g - 1) / p * n / cluster.nvlink.bandwidth + (g - 1) * cluster.nvlink.latency


def broadcast_seconds(n: float, p: int, cluster: Cluster) -> float:
    g, nodes = _layout(p, cluster)
    chain = lambda hops, link: (n / link.bandwidth + hops * link.latency) if hops else 0.0  # noqa: E731
    return chain(nodes - 1, cluster.network) + chain(g - 1, cluster.nvlink)


_SECONDS = {"all_reduce": all_reduce_seconds, "all_gather": all_gather_seconds, "all_to_all": all_to_all_seconds,
            "broadcast": broadcast_seconds}
KINDS = tuple(_SECONDS)  # the collective kinds `Comm` counts


def collective_seconds(kind: str, n: float, p: int, cluster: Cluster) -> float:
    """Modelled seconds of collective `kind` ("all_reduce", "all_gather", "all_to_all", "broadcast") of `n` bytes
    per rank over `p` ranks (0 for a world of one)."""
    return _SECONDS[kind](n, p, cluster) if p > 1 else 0.0
