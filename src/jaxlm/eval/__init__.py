"""Evaluation: held-out loss and sampling of a run, lm-evaluation-harness tasks through the server."""
