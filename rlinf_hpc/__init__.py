"""rlinf_hpc: RL post-training as SLURM jobs of MPI ranks.

Rank 0 is the coordinator: it runs the user's macro flow (plain Python) and drives component
groups of worker ranks, each with its own MPI communicator.
"""

__version__ = "0.1.0"
