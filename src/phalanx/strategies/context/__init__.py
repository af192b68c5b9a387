"""Context parallel: one long sequence split over the ranks of a cp group.

shard.py cuts a batch along the sequence (the load-balanced cut for causal masks), layout.py says
which global positions this rank holds and which mask the batch carries, masks.py turns that into
the allowed (query, key) pairs, comm.py holds the autograd Functions over torch's collectives, and
attention.py runs attention across the cut with Ulysses (all-to-all over heads) or an all-gather
of keys and values. transformers models reach it through hf.py's attention function.
"""

from phalanx.strategies.context.cut_attention import attention, choose_algorithm
from phalanx.strategies.context.layout import SequenceLayout, active_layout, using_layout
from phalanx.strategies.context.shard import shard_sequence

__all__ = ["SequenceLayout", "active_layout", "attention", "choose_algorithm", "shard_sequence", "using_layout"]
