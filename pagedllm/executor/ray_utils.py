"""Joining Ray: the cluster at RAY_ADDRESS when set (`ray start --head`, or a multi-node
cluster), else an already initialised Ray, else a private local one on 127.0.0.1."""
from __future__ import annotations

import os


def import_ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("Ray is not installed: pip install 'pagedllm[ray]'") from e
    return ray


def init_ray(num_cpus: int) -> bool:
    """Connect this process to Ray; True when it started a local cluster it must shut down."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    # A private local cluster on the loopback interface, for this process only.
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=128 << 20, log_to_driver=True)
    return True
