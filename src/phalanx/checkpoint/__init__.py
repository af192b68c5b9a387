"""Checkpoints: atomic sharded saves through torch.distributed.checkpoint, exact resume, export.

Layout of a checkpoint directory (one per save, published by a rename):
  manifest.json        world size, strategy, step, every file's size and sha256 (written last)
  .metadata, *.distcp  DCP: model and optimizer, one shard file per rank
  common.pt            counters, data positions, schedulers, scalers, registered objects
  rank{r}.pt           per-rank RNG states (python, numpy, torch, CUDA)
A managed root (`Phalanx(checkpoint_dir=...)`) holds `step-XXXXXXXX/` directories and a `latest`
pointer file. Everything is read with `weights_only=True` or a restricted unpickler: no code runs.
"""
