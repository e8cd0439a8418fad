"""Tensor and pipeline parallelism over torch.distributed: which rank holds which part of the
model (sharding.py), and the process groups with the collectives the model needs
(parallel_state.py). The processes themselves are started by pagedllm.executor."""
