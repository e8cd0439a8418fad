"""Attention backends: one interface (abstract.py), one folder per implementation holding all of
it (backend class, step metadata, forward, kernels), one line each in registry.py; picked once
by attention/selector.py when the model is built."""
