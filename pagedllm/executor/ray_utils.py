"""Joining Ray: the cluster at RAY_ADDRESS when set (`ray start --head`, or a multi-node
cluster), else an already initialised Ray, else a private local one on 127.0.0.1."""

from __future__ import annotations

import os
import sys


def import_ray():
    if "ray" not in sys.modules and not os.environ.get("RAY_ADDRESS"):
        # A private local cluster stays on the loopback interface: without this (read when ray is
        # imported) Ray binds every service, 127.0.0.1 or not, to the default route's address.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
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
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 << 20,
        log_to_driver=True,
    )
    return True
