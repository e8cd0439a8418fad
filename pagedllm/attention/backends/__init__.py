"""Attention backends: one interface (abstract.py), one file per implementation, picked once by
attention/selector.py when the model is built."""
