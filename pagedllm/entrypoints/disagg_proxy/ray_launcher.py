"""`pagedllm proxy --launch-ray '{"prefill": N, "decode": M}' --serve-args "..."`: the proxy starts
its prefill and decode instances as Ray actors on the cluster at RAY_ADDRESS (else a local one).

Each actor (`InstanceActor`, 1 CPU by default, spread over the nodes) runs one real `pagedllm
serve` process on its node with the ZMQ connector in its role, listening on the node's address
(`kv_ip` too), so KV moves over TCP between nodes; peers need no static configuration: the
prefill's answer carries its address in `kv_transfer_params`. The actors are owned by the proxy
(Ray kills them if the proxy dies) and each server dies with its actor (PR_SET_PDEATHSIG);
`RayInstances.shutdown` stops the servers, then the actors. pagedllm must be importable on every
node (the same install, or PYTHONPATH)."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.server_process import ServerProcess, free_port
from pagedllm.json_config import fields_from_json

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "pagedllm"  # the actors are named pagedllm-proxy-{port}-{role}-{i} there
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass
class LaunchSpec:
    prefill: int = 1
    decode: int = 1
    num_cpus: float = 1.0  # Ray CPUs reserved per instance
    start_timeout_s: float = 300.0  # an instance not answering /health by then fails the launch
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_cli(cls, value: "str | dict") -> "LaunchSpec":
        spec = cls(**fields_from_json(value, cls, "--launch-ray"))
        for name in ("prefill", "decode"):
            n = getattr(spec, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"--launch-ray.{name} must be an integer >= 1, got {n!r}")
        for name in ("num_cpus", "start_timeout_s"):
            v = getattr(spec, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"--launch-ray.{name} must be a number > 0, got {v!r}")
        if not isinstance(spec.kv_connector_extra_config, dict):
            raise ValueError("--launch-ray.kv_connector_extra_config must be an object")
        return spec


def _node_address(ray) -> str:
    """This node's address as the cluster registered it (NodeManagerAddress): 127.0.0.1 on a
    loopback cluster, the host's address on a multi-host one; the one the other nodes reach."""
    node_id = ray.get_runtime_context().get_node_id()
    known = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]
    return known[0] if known else ray.util.get_node_ip_address()


class InstanceActor:
    """One `pagedllm serve` on this actor's node (made a Ray actor class by `RayInstances`)."""

    def __init__(self, role: str, serve_args: list[str], extra: dict, start_timeout_s: float) -> None:
        import ray

        self.ip = _node_address(ray)
        self.port = free_port(self.ip)
        kv = {
            "kv_connector": "ZmqConnector",
            "kv_role": ROLES[role],
            "kv_ip": self.ip,
            "kv_connector_extra_config": extra,
        }
        cmd = [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--host",
            self.ip,
            "--port",
            str(self.port),
            "--kv-transfer-config",
            json.dumps(kv),
            *serve_args,
        ]
        self.server = ServerProcess(cmd, f"http://{self.ip}:{self.port}", name=role, die_with_parent=True)
        self.start_timeout_s = start_timeout_s

    def wait_ready(self) -> dict:
        """{url, pid} once the server answers /health; RuntimeError with its log if it cannot."""
        self.server.wait_ready(self.start_timeout_s)
        return {
            "url": self.server.url,
            "pid": self.server.proc.pid,
            "actor_pid": os.getpid(),
            "log": self.server.log.name,
        }

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM to the server's session (the server and its engine core), SIGKILL after
        `timeout`; -> its exit code."""
        return self.server.stop(timeout)


class RayInstances:
    """The proxy's instances as Ray actors: `launch` -> prefill and decode URLs; `shutdown`."""

    def __init__(self, spec: LaunchSpec, serve_args: list[str], name_prefix: str) -> None:
        from pagedllm.executor.ray_utils import import_ray, init_ray

        self.ray = ray = import_ray()
        self.owns_ray = init_ray(int(max(spec.num_cpus * (spec.prefill + spec.decode), os.cpu_count() or 1)))
        actor_cls = ray.remote(InstanceActor)
        self.actors: list = []
        self.info: dict[str, list[dict]] = {"prefill": [], "decode": []}
        try:
            for role in ("prefill", "decode"):
                for i in range(getattr(spec, role)):
                    self.actors.append(
                        (
                            role,
                            actor_cls.options(
                                name=f"{name_prefix}-{role}-{i}",
                                namespace=RAY_NAMESPACE,
                                num_cpus=spec.num_cpus,
                                scheduling_strategy="SPREAD",
                            ).remote(role, serve_args, spec.kv_connector_extra_config, spec.start_timeout_s),
                        )
                    )
            # Bounded twice: each actor gives up after start_timeout_s, Ray's wait a little later
            # (an actor that cannot be placed never answers).
            refs = [a.wait_ready.remote() for _, a in self.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=spec.start_timeout_s + 30)
            if len(ready) < len(refs):
                raise RuntimeError(
                    f"Ray started {len(ready)} of {len(refs)} instances within "
                    f"{spec.start_timeout_s + 30:.0f} s (cluster resources: {ray.cluster_resources()})"
                )
            for (role, _), info in zip(self.actors, ray.get(refs)):
                self.info[role].append(info)
                logger.warning(
                    "%s instance at %s (server pid %d, Ray actor pid %d)",
                    role,
                    info["url"],
                    info["pid"],
                    info["actor_pid"],
                )
        except BaseException:
            self.shutdown()
            raise

    @property
    def prefill_urls(self) -> list[str]:
        return [i["url"] for i in self.info["prefill"]]

    @property
    def decode_urls(self) -> list[str]:
        return [i["url"] for i in self.info["decode"]]

    def shutdown(self, timeout: float = 30.0) -> None:
        ray = self.ray
        if self.actors:
            refs = [a.stop.remote(timeout) for _, a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=timeout + 15)
            for _, a in self.actors:
                ray.kill(a, no_restart=True)
            self.actors = []
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
