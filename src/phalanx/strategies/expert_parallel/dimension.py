"""ep as the strategy applies it to each prepared model, through the hooks every such dimension
offers (strategies/dimensions.py): where it runs in parallelize's order, the model's experts split,
and what the split asks of clipping, the optimizer, full weights and the step's report."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.strategies.expert_parallel import ExpertParallel, after_tp, apply
from phalanx.strategies.expert_parallel import clip as expert_clip
from phalanx.strategies.layout import Layout


class ExpertDimension:
    """Expert parallel (`ep`) of one strategy: each prepared model's experts split over the ep ranks."""

    def __init__(self, layout: Layout, device: torch.device, options: Any):
        self.layout, self.device, self.options = layout, device, options
        # under tp, of the parts tensor parallel split first (parallelize calls it after tp)
        self.after_tp = after_tp(layout.plan)

    def apply(self, model: nn.Module) -> ExpertParallel | None:
        """Each MoE layer keeps this rank's experts and sends tokens to theirs (before DDP wraps it);
        None when ep is 1."""
        experts = apply(model, self.layout, self.device, self.options.ep_plan, self.options.capacity_factor)
        if experts is not None:  # torch's clip scales plain expert and DTensor gradients apart
            expert_clip.scale_each_kind()
        return experts
