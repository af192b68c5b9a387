"""The optimizer step in every layout: which optimizers may step on slices (optimizer_kinds), zero1's
sharded optimizer with its gradient chunks and gathered buckets, whole-tensor optimizers over split
tensors, one closure loss for every replica, and the global gradient norm for clipping. Below the
modules that apply a plan: it imports from strategies/ only the plan (tests/unit/test_layering.py)."""
