"""The ray executor: ranks 1..world_size-1 as Ray actors in a placement group (one bundle per
rank; bundle 0 is held for the driver, which runs rank 0 in this process).

It joins the cluster at RAY_ADDRESS when set (`ray start --head` on one node, or a multi-node
cluster), else an already initialised Ray, else starts a local one on 127.0.0.1 for the
engine's lifetime. Control messages are actor calls; tensors move through torch.distributed
(Gloo here, NCCL on GPUs), whose groups bind to each actor's node address. A dead actor makes
the driver's next collective fail; the executor reports Ray's ActorDiedError with the rank.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from pagedllm import envs
from pagedllm.executor.abstract import ExecutorError
from pagedllm.executor.distributed_executor import DistributedExecutor
from pagedllm.executor.ray_utils import import_ray, init_ray
from pagedllm.executor.worker_main import STEP_CALLS

logger = logging.getLogger(__name__)


def _ray():
    try:
        return import_ray()
    except ValueError as e:  # pragma: no cover - depends on the install
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'pagedllm[ray]'") from e


class RayDistributedExecutor(DistributedExecutor):
    backend_name = "ray"

    def _driver_host(self) -> str:
        ray = _ray()
        self._owns_ray = init_ray(max(self.world_size, os.cpu_count() or 1))
        return ray.util.get_node_ip_address()

    def _start_workers(self) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from pagedllm.worker.worker import Worker

        self.workers: list = []
        self._pending: list = []  # the last non-step call (start-up, KV cache)
        self._outstanding: list = []  # (rank, ref) of step calls not yet reaped
        self._pids: list[int] = []
        bundles = [{"CPU": 1} for _ in range(self.world_size)]
        self.pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ExecutorError(
                f"Ray could not place {self.world_size} bundles of 1 CPU within "
                f"{envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})"
            )
        actor_cls = ray.remote(num_cpus=1)(Worker)
        for rank in range(1, self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            # host=None: the actor binds its Gloo device to its own node's address.
            self.workers.append(
                actor_cls.options(scheduling_strategy=strategy, max_concurrency=1, name=None).remote(
                    self.config, self.eos_token_ids, rank, self.host, self.master_port, None, self.num_threads
                )
            )
        self._pids = ray.get([w.get_pid.remote() for w in self.workers], timeout=envs.PAGEDLLM_WORKER_START_TIMEOUT_S)

    def worker_pids(self) -> list[int]:
        return list(getattr(self, "_pids", []))

    def _send_all(self, method: str, args: tuple, ranks=None) -> None:
        if method == "execute_model_worker" and len(self.workers) > 1:
            ray = _ray()
            args = (ray.put(args[0]), args[1])  # one copy of the SchedulerOutput for all actors
        refs = [
            (rank, getattr(w, method).remote(*args))
            for rank, w in enumerate(self.workers, start=1)
            if ranks is None or rank in ranks
        ]
        if method in STEP_CALLS:
            self._outstanding.extend(refs)
        else:
            self._pending = [ref for _, ref in refs]

    def _collect_all(self, timeout: float, what: str) -> list:
        ray = _ray()
        pending, self._pending = self._pending, []
        try:
            return ray.get(pending, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorError(f"a Ray worker did not answer within {timeout:.0f} s while {what}") from None
        except ray.exceptions.RayError as e:
            raise ExecutorError(f"{self._describe(e)} while {what}") from e

    def _after_step(self, wait: bool) -> None:
        ray = _ray()
        refs = [ref for _, ref in self._outstanding]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S if wait else 0)
        if wait and len(ready) < len(refs):
            raise ExecutorError(
                f"a Ray worker did not finish its step within {envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S:.0f} s"
            )
        done = set(ready)
        try:
            ray.get(ready)
        except ray.exceptions.RayError as e:
            raise ExecutorError(self._dead_worker() or self._describe(e)) from e
        self._outstanding = [(r, ref) for r, ref in self._outstanding if ref not in done]

    def _describe(self, err) -> str:
        return f"a Ray worker failed: {type(err).__name__}: {err}"

    def _dead_worker(self, wait: float = 0.0) -> Optional[str]:
        ray = _ray()
        calls = list(getattr(self, "_outstanding", []))
        calls += [(i + 1, ref) for i, ref in enumerate(getattr(self, "_pending", []))]
        if not calls:
            return None
        deadline = time.monotonic() + wait
        while True:
            ready, _ = ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=0)
            ready = set(ready)
            for rank, ref in calls:
                if ref not in ready:
                    continue
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError as e:
                    pid = self._pids[rank - 1] if rank - 1 < len(self._pids) else "?"
                    kind = "died" if isinstance(e, ray.exceptions.RayActorError) else "failed"
                    return f"worker rank {rank} (Ray actor, pid {pid}) {kind}: {type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _stop_workers(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            return
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        pg = getattr(self, "pg", None)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.workers, self._pending, self._outstanding = [], [], []
        # Actors end asynchronously: wait (bounded) until their processes are gone.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p) for p in self._pids):
            time.sleep(0.1)
        if getattr(self, "_owns_ray", False):
            ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
