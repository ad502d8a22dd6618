"""Inference: sampling, generate, speculative decoding and the Python API."""
