"""What phalanx does to a model that is not a parallel layout: building it on the meta device and
initialising its shards, loading full weights into any layout, the units a model is cut into, and
the per-unit transforms (activation checkpointing, compile); plus the memory a model's state takes
per rank under each layout."""
