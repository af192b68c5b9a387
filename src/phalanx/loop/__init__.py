"""The training loop's wrappers around the user's objects: accumulation (which micro-step syncs,
the optimizer that steps once per cycle), LR schedulers that step only after a real step, and the
numerics of mixed precision (autocast, FSDP2's policy, the fp16 scaler)."""
