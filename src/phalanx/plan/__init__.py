"""`phalanx plan`: per-strategy memory plan for a model, before launching anything."""
