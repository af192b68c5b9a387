"""Data across ranks: sharding samplers, streams split by shard, and the prepared loader.

Public: `ShardedStream(shards, read)` and `tar_samples` (a stream whose shards phalanx deals to the
ranks and workers, each read once in the job; docs/data.md).
"""

from phalanx.data.streaming import ShardedStream, tar_samples

__all__ = ["ShardedStream", "tar_samples"]
