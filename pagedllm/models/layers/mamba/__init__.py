"""Kernels of recurrent layers (short convolutions, selective scan, the gated delta rule), in
vectorised torch."""
