"""`phalanx doctor`: check a machine (and a SLURM allocation) for what breaks launches, before one."""
