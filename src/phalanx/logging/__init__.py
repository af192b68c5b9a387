"""What a training run shows and leaves behind: phalanx's own rank-aware log messages, the user's
metrics (`px.log`) with their sinks, the progress bar (`px.progress`), and `phalanx plot`.

`session.start(ctx)` wires them up for one `Phalanx()`; each concern has its own module.
"""
