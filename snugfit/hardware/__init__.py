"""Hardware: a catalogue of GPUs, links and hosts, cluster specs, and measurement of this machine.

catalogue.py and cluster.py are pure data (plan/ uses them); measure.py runs torch.
"""

from snugfit.hardware.catalogue import GPU, GPUS, LINKS, Host, Link, LocalHardware, get_gpu, get_link, load_local
from snugfit.hardware.cluster import Cluster, Node, load_cluster_toml, parse_cluster

__all__ = [
    "GPU", "GPUS", "LINKS", "Cluster", "Host", "Link", "LocalHardware", "Node",
    "get_gpu", "get_link", "load_cluster_toml", "load_local", "parse_cluster",
]
