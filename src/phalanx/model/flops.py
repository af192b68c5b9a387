"""Training FLOPs per token of the models phalanx can count: transformer stacks. Nothing is guessed
for other models (MFU is then not reported).

Per token of a sequence of T tokens, for N weights outside the embedding tables (N_t of them
trainable), L attention layers of width d (PaLM, appendix B; torchtitan and nanoGPT use the same):
forward 2N, backward 2N for the activations' gradients plus 2N_t for the weights' (6N when every
weight trains; a LoRA run with frozen weights does ~4N), and 12·L·d·T for the attention scores and
their use (fwd + bwd), which have no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a model is read: the step-time model (plan/step_time.py) is pure Python
    from torch import nn


@dataclass(frozen=True)
class TransformerShape:
    """What the count needs: weights outside embeddings, trainable ones among them, layers, width."""

    num_params: int
    num_trainable: int
    num_layers: int
    width: int

    def flops_per_token(self, seq_len: int) -> float:
        return 4 * self.num_params + 2 * self.num_trainable + 12 * self.num_layers * self.width * seq_len


def transformer_shape(model: nn.Module) -> TransformerShape | None:
    """The shape of a transformer stack, or None for a model that is not one (no guess).

    A transformers model (also inside a wrapper such as peft's) by its config's num_hidden_layers and
    hidden_size; otherwise a model built of torch's nn.MultiheadAttention layers of one width."""
    from torch import nn

    layers_width = _from_config(model) or _from_attention_layers(model)
    if layers_width is None:
        return None
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    params = [p for p in model.parameters() if id(p) not in embeddings]
    num = sum(p.numel() for p in params)
    return TransformerShape(num, sum(p.numel() for p in params if p.requires_grad), *layers_width)


def _from_config(model: nn.Module) -> tuple[int, int] | None:
    for module in model.modules():
        config = getattr(module, "config", None)
        layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
        if isinstance(layers, int) and isinstance(width, int) and layers > 0 and width > 0:
            return layers, width
    return None


def _from_attention_layers(model: nn.Module) -> tuple[int, int] | None:
    from torch import nn

    widths = [m.embed_dim for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    if not widths or len(set(widths)) != 1:
        return None
    return len(widths), widths[0]
