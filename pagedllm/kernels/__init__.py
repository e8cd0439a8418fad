"""What every family of GPU kernels shares: how a Triton launch is described and made
(triton_launch.py), and how such a description is compiled ahead for a GPU that is not here
(triton_aot.py). The kernels themselves live with their users (attention/backends/triton_attn/,
lora/triton_ops.py, models/layers/)."""
