"""Data across ranks: sharding samplers and the prepared loader."""
