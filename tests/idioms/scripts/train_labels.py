"""The corpus's `labels` loop as a script a user runs (`python train_labels.py`, `phalanx run ...`,
`phalanx parity --steps 3 ...`): a tiny transformers Llama, `model(input_ids=ids, labels=ids).loss`,
`px.backward`, torch's `clip_grad_norm_`, AdamW; 4 rows per process (a fixed per-process batch, as
`phalanx parity` wants)."""

import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

px = Phalanx()
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
model = transformers.LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
rows = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(rows), batch_size=4, shuffle=True)
model, optimizer, loader = px.prepare(model, optimizer, loader)
for step, (ids,) in enumerate(loader, 1):
    loss = model(input_ids=ids, labels=ids).loss
    px.backward(loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    px.print(f"step {step}: loss {px.reduce(loss.detach()).item():.6f}, grad norm {float(norm):.6f}")
