"""Plan arithmetic: the ParallelPlan, the presets that build it, the job's one plan handed to the
workers, and the settings checked against it. Pure Python (no torch at import), so the launcher and
`phalanx plan` use it without starting torch (tests/unit/test_layering.py checks)."""
