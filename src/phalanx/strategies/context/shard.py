"""`shard_sequence`: cut a batch along the sequence for this rank of a cp group.

Inputs are a tensor [batch, seq] or a dict of them (input_ids, position_ids, attention_mask,
labels...): every tensor whose sequence dim has the batch's length is cut, others pass whole.
position_ids are added to a dict when missing (global positions 0..S-1), so positions stay global;
a transformers model called with a plain token tensor gets them from the layout (hf.py). Targets
must be shifted already (targets[t] is the token after t, as transformers' `shift_labels`): a
shift after the cut would pair a token with one held by another rank (a transformers causal LM's
`labels=` in the inputs are shifted before the cut: labels.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from phalanx.strategies.context import masks
from phalanx.strategies.context.layout import SequenceLayout, local_indices, set_active

IGNORE_INDEX = -100  # transformers' and cross_entropy's "no target here"


def shard_sequence(
    inputs: Any,
    targets: Any = None,
    *,
    cp_size: int,
    cp_rank: int,
    group: Any = None,
    pad: bool = False,
    seq_dim: int = 1,
    activate: bool = True,
) -> tuple[Any, Any, SequenceLayout]:
    """This rank's part of `inputs` and `targets`, and the layout attention reads (made active
    unless activate=False). pad=True pads a sequence that does not cut into 2 x cp chunks: padded
    keys are masked, padded targets IGNORE_INDEX."""
    main = _main_tensor(inputs)
    batch, seq_len = main.shape[0], main.shape[seq_dim]
    fields = dict(inputs) if isinstance(inputs, Mapping) else {}
    positions = fields.get("position_ids")
    if positions is None:
        positions = torch.arange(seq_len, device=main.device).expand(batch, seq_len)
        if isinstance(inputs, Mapping):  # the model must see global positions, not 0..S/cp-1
            fields["position_ids"] = positions
    padding = fields.get("attention_mask")
    extra = -seq_len % (2 * cp_size) if pad else 0
    if extra:
        # padding continues the last document (its keys are masked, its targets ignored)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=main.device)], 1)
        real = padding if padding is not None else torch.ones(batch, seq_len, dtype=torch.long, device=main.device)
        padding = torch.cat([real, real.new_zeros(batch, extra)], 1)
        fields = {
            name: positions if name == "position_ids" else _grow(value, seq_len, extra, 0, seq_dim)
            for name, value in fields.items()
        }
        inputs = fields if isinstance(inputs, Mapping) else _grow(inputs, seq_len, extra, 0, seq_dim)
        targets = _grow(targets, seq_len, extra, IGNORE_INDEX, seq_dim)
        seq_len += extra
    index = local_indices(seq_len, cp_size, cp_rank).to(main.device)
    layout = SequenceLayout(
        cp_size,
        cp_rank,
        group,
        seq_len,
        documents=masks.documents_of(positions),
        key_padding=None if padding is None or bool(padding.all()) else padding.bool(),
        attention_mask_given="attention_mask" in fields,
    )
    if isinstance(inputs, Mapping):
        local: Any = {
            name: _cut(value, index, seq_len, seq_dim) for name, value in fields.items() if name != "attention_mask"
        }  # the layout carries the mask: the model's own would be local
    else:
        local = _cut(inputs, index, seq_len, seq_dim)
    if activate:
        set_active(layout)
    return local, _cut(targets, index, seq_len, seq_dim), layout


def _main_tensor(inputs: Any) -> torch.Tensor:
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping):
        for name in ("input_ids", "inputs_embeds"):
            if isinstance(inputs.get(name), torch.Tensor):
                return inputs[name]
        tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
        if tensors:
            return tensors[0]
    raise ValueError(
        f"shard_sequence: inputs must be a tensor [batch, seq] or a dict of them (input_ids, "
        f"position_ids, attention_mask), not {type(inputs).__name__}"
    )


def _cut(value: Any, index: torch.Tensor, seq_len: int, seq_dim: int) -> Any:
    if isinstance(value, Mapping):
        return {k: _cut(v, index, seq_len, seq_dim) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_len:
        return value.index_select(seq_dim, index.to(value.device))
    return value


def _grow(value: Any, seq_len: int, extra: int, fill: int, seq_dim: int) -> Any:
    if isinstance(value, Mapping):
        return {k: _grow(v, seq_len, extra, fill, seq_dim) for k, v in value.items()}
    if not isinstance(value, torch.Tensor) or value.dim() <= seq_dim or value.shape[seq_dim] != seq_len:
        return value
    shape = list(value.shape)
    shape[seq_dim] = extra
    return torch.cat([value, torch.full(shape, fill, dtype=value.dtype, device=value.device)], dim=seq_dim)
