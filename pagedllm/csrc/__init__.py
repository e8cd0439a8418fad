"""The C++ CPU kernels as source files (attention.cpp, fused_ops.cpp, decode_loop.cpp, one
bindings.cpp; cpu_types.h and ops.h shared), built into one extension by `build.py`."""
