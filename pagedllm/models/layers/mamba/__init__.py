"""Kernels of recurrent layers (short convolutions, selective scan), in vectorised torch."""
