"""`phalanx run`: the launcher process.

Flags -> a validated `LaunchSpec` -> torch's elastic agent, which starts the workers with exactly
torchrun's environment. Nothing here imports `phalanx.runtime`, and torch is imported only after the
spec has been validated, so bad input fails in a fraction of a second.
"""
