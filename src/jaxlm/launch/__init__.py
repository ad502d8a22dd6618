"""Launching jobs: local processes, Slurm / Kubernetes / TPU VM clusters, jax.distributed, TPU topologies."""
