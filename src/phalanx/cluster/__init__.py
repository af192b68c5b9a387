"""Where the job runs: SLURM allocations, networks, rendezvous addresses.

Pure functions over explicit inputs (an environment mapping, addresses): no torch import, so the
launcher can use them before anything is spawned and tests need no cluster.
"""
