"""Workloads for context parallel tests: run on each rank by tests.dist.harness."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from phalanx.strategies.context import attention as cp_attention
from phalanx.strategies.context import shard_sequence

MASKS = ("causal", "packed", "window", "padding")


def batch_of(mask: str, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Inputs whose position_ids / attention_mask make `mask` (window is set at the call)."""
    fields = {"input_ids": torch.arange(batch * seq).reshape(batch, seq)}
    if mask == "packed":  # row 0: documents of 5, 7, 4 tokens; row 1: 9, 7
        fields["position_ids"] = torch.tensor([[*range(5), *range(7), *range(4)], [*range(9), *range(7)]])
    if mask == "padding":  # row 0 left-padded by 3, row 1 right-padded by 6
        fields["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
        fields["attention_mask"][0, :3] = 0
        fields["attention_mask"][1, -6:] = 0
    return fields


def attention_case(
    mask: str, algorithm: str, heads: int, kv_heads: int, cp_size: int, cp_rank: int, group: object
) -> dict[str, torch.Tensor]:
    """Output and q/k/v gradients of this rank's tokens (cp_size 1: the whole sequence)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mask, heads, kv_heads)).encode()))
    b, s, d = 2, 16, 8
    q = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s, d, generator=gen, dtype=torch.float64)
    up = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    _, _, layout = shard_sequence(batch_of(mask), cp_size=cp_size, cp_rank=cp_rank, group=group, activate=False)
    index = layout.local
    q, k, v = (t[:, :, index].clone().requires_grad_() for t in (q, k, v))
    out = cp_attention(q, k, v, sliding_window=5 if mask == "window" else None, algorithm=algorithm, layout=layout)
    out.backward(up[:, :, index])
    return {"index": index, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


CASES = [(m, a, h, kv) for m in MASKS for a, h, kv in (("ulysses", 4, 2), ("allgather", 4, 1), ("allgather", 2, 2))]


def attention_cases() -> dict[tuple, dict[str, torch.Tensor]]:
    """Every case at cp = world size, in one launch."""
    dist.init_process_group("gloo")
    try:
        return {case: attention_case(*case, dist.get_world_size(), dist.get_rank(), None) for case in CASES}
    finally:
        dist.barrier()
        dist.destroy_process_group()


# ---- a tiny Llama trained through px.forward_backward at cp > 1, against one process -----------
VOCAB, SEQ, SAMPLES = 64, 16, 48


def tiny_llama(kv_heads: int = 2, sliding_window: int | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4 * SEQ,
        attn_implementation="sdpa",
    )
    if sliding_window is not None:
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window))
    return LlamaForCausalLM(LlamaConfig(**shape))


def rows() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g))


def llm_inputs(mask: str, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's inputs for a batch of rows (targets: tokens[:, 1:], shifted before any cut)."""
    fields = {"input_ids": tokens[:, :-1], "use_cache": False}
    if mask == "packed_with_cache":  # the config's default use_cache=True: one process then reads no documents
        del fields["use_cache"]
    if mask in ("packed", "packed_with_cache"):  # three documents per row: 5, 7 and 4 tokens
        fields["position_ids"] = torch.tensor([*range(5), *range(7), *range(4)]).expand(len(tokens), SEQ)
    if mask == "padding":  # the last 5 tokens of every row are padding, their targets ignored
        fields["attention_mask"] = torch.ones(len(tokens), SEQ, dtype=torch.long)
        fields["attention_mask"][:, -5:] = 0
    return fields


def llm_targets(mask: str, tokens: torch.Tensor) -> torch.Tensor:
    targets = tokens[:, 1:].clone()
    if mask == "padding":
        targets[:, -5:] = -100
    return targets


def mean_loss(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def summed_loss(output, targets):
    return torch.nn.functional.cross_entropy(
        output.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )


def llm_reference(mask: str, global_batch: int, steps: int, num_items: bool, **model_args) -> list[float]:
    model = tiny_llama(**model_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(torch.utils.data.DataLoader(rows(), batch_size=global_batch))
    losses = []
    for _ in range(steps):
        (tokens,) = next(batches)
        targets = llm_targets(mask, tokens)
        inputs = llm_inputs(mask, tokens)
        if mask == "packed":  # transformers' block-diagonal causal needs no attention_mask and no cache
            inputs.pop("attention_mask", None)
        if num_items:
            loss = summed_loss(model(**inputs), targets) / (targets != -100).sum()
        else:
            loss = mean_loss(model(**inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_llm(
    mask: str,
    global_batch: int = 4,
    steps: int = 6,
    num_items: bool = False,
    model_args: dict | None = None,
    save: tuple[int, str] | None = None,
    resume: str | None = None,
    **settings,
) -> dict:
    """`steps` AdamW steps of the tiny Llama through px.forward_backward in the layout `settings`
    describe (save=(step, path): a checkpoint after that many steps; resume: start from one, going
    on to `steps`); rank 0 also returns the one-process reference."""
    from phalanx import Phalanx
    from phalanx.strategies.context import cut_attention as attention_module

    model_args = model_args or {}
    px = Phalanx(**settings)
    model = tiny_llama(**model_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(rows(), batch_size=global_batch // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    if resume is not None:
        assert px.load_state(resume)
    losses = llm_steps(px, model, optimizer, loader, mask, num_items, steps - px.global_step, save)
    result = {
        "losses": losses,
        "cp_size": px.cp_size,
        "cp_rank": px.cp_rank,
        "dp_size": px.dp_size,
        "algorithm": attention_module.last_used.get("algorithm"),
    }
    if px.rank == 0 and resume is None:
        result["reference"] = llm_reference(mask, global_batch, steps, num_items, **model_args)
    px.wait_for_everyone()
    return result


def llm_steps(
    px, model, optimizer, loader, mask: str, num_items: bool, steps: int, save: tuple[int, str] | None = None
) -> list[float]:
    """`steps` prepared steps through px.forward_backward; each step's whole-batch loss."""
    losses: list[float] = []
    for (tokens,) in loader:
        if len(losses) == steps:
            break
        targets = llm_targets(mask, tokens)
        if num_items:
            count = (targets != -100).sum()
            px.forward_backward(model, llm_inputs(mask, tokens), targets, summed_loss, num_items=count)
            optimizer.step()
            losses.append(px.step_loss)
        else:
            loss = px.forward_backward(model, llm_inputs(mask, tokens), targets, mean_loss)
            optimizer.step()
            losses.append(px.reduce(loss).item())
        optimizer.zero_grad()
        if save is not None and px.global_step == save[0]:
            px.save_state(save[1])
    return losses


# each mask as the tests train it: (inputs' mask, model_args); the window is Mistral's sliding_window
MASK_CASES = {
    "causal": ("causal", {}),
    "packed": ("packed", {}),
    "window": ("causal", {"sliding_window": 5}),
    "padding": ("padding", {}),
}


def train_llm_masks(global_batch: int = 4, steps: int = 6) -> dict:
    """Every mask of MASK_CASES trained in one launch, one Phalanx (the layout from the env), a fresh
    model per mask; rank 0 also returns each mask's one-process reference. Every mask weighs its loss
    with num_items (exact for each; a run passes num_items on every backward or on none)."""
    from phalanx import Phalanx
    from phalanx.strategies.context import cut_attention as attention_module

    px = Phalanx()
    result: dict = {"cp_size": px.cp_size, "cp_rank": px.cp_rank, "dp_size": px.dp_size}
    for name, (mask, model_args) in MASK_CASES.items():
        model = tiny_llama(**model_args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(rows(), batch_size=global_batch // px.dp_size)
        model, optimizer, loader = px.prepare(model, optimizer, loader)
        attention_module.last_used.pop("algorithm", None)
        result[name] = {
            "losses": llm_steps(px, model, optimizer, loader, mask, True, steps),
            "algorithm": attention_module.last_used.get("algorithm"),
        }
        if px.rank == 0:
            result[name]["reference"] = llm_reference(mask, global_batch, steps, True, **model_args)
    px.wait_for_everyone()
    return result


# ---- a model of the user's own: attention by F.scaled_dot_product_attention or px.attention ----
class OwnAttentionLM(torch.nn.Module):
    """Embeddings with learned positions (read from position_ids: global under cp), one attention
    block, a head. `attend`: "sdpa" (torch's call, routed under cp), "px" (px.attention), "manual"
    (softmax written out: cannot be routed), "mha" (nn.MultiheadAttention: refused)."""

    def __init__(self, attend: str = "sdpa", px=None):
        super().__init__()
        torch.manual_seed(0)
        self.attend, self.px, self.heads = attend, px, 4
        self.embed, self.pos = torch.nn.Embedding(VOCAB, 32), torch.nn.Embedding(SEQ, 32)
        self.qkv, self.out, self.head = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), torch.nn.Linear(32, VOCAB)
        if attend == "mha":
            self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        h = self.embed(input_ids) + self.pos(position_ids)
        b, s, _ = h.shape
        q, k, v = (t.reshape(b, s, self.heads, 8).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        if self.attend == "px":
            a = self.px.attention(q, k, v, causal=True)
        elif self.attend == "manual":
            scores = (q @ k.transpose(-1, -2)) / 8**0.5
            a = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + self.out(a.transpose(1, 2).reshape(b, s, 32)))


def logits_loss(output, targets):
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())


def _cp_mean(loss: torch.Tensor) -> float:
    """The whole rows' mean loss from each cp rank's part (cp = every rank here)."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def train_own_model(steps: int = 6) -> dict:
    """The own-attention model at cp = world size through sdpa and px.attention, then the refusals."""
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", cp=2)
    result: dict = {}
    for attend in ("sdpa", "px", "hand"):  # hand: px.attention in a hand-written loop with px.shard_sequence
        model = OwnAttentionLM("px" if attend == "hand" else attend, px)
        reference = OwnAttentionLM("sdpa")  # same seed: same weights; torch attention over the whole rows
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        model, optimizer = px.prepare(model, optimizer)
        losses, ref_losses = [], []
        for (tokens,) in list(torch.utils.data.DataLoader(rows(), batch_size=4))[:steps]:
            if attend == "hand":
                inputs, targets = px.shard_sequence({"input_ids": tokens[:, :-1]}, tokens[:, 1:])
                loss = logits_loss(model(**inputs), targets)
                px.backward(loss)
                losses.append(px.reduce(loss.detach()).item() if px.cp_size == 1 else _cp_mean(loss))
            else:
                losses.append(
                    px.forward_backward(model, {"input_ids": tokens[:, :-1]}, tokens[:, 1:], logits_loss).item()
                )
            optimizer.step()
            optimizer.zero_grad()
            ref_loss = logits_loss(reference(tokens[:, :-1]), tokens[:, 1:])
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            ref_losses.append(ref_loss.item())
        result[attend] = (losses, ref_losses)
        if attend == "hand":  # the cut ended with px.backward: a whole row attends over itself
            tokens = rows()[:2][0][:, :-1]
            with torch.no_grad():
                result["whole_row"] = (px.unwrap_model(model)(tokens), reference(tokens))
    for attend in ("mha", "manual"):
        try:
            model = px.prepare(OwnAttentionLM(attend, px))
            tokens = rows()[:2][0]
            px.forward_backward(model, {"input_ids": tokens[:, :-1]}, tokens[:, 1:], logits_loss)
        except ValueError as error:
            result[attend] = str(error)
    try:  # no sequence at all: an MLP's features cut as one fail in its first layer, refused with cp's reason
        mlp = px.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
        px.forward_backward(mlp, torch.randn(4, 8), torch.randn(4, 4), torch.nn.functional.mse_loss)
    except (ValueError, RuntimeError) as error:
        result["mlp"] = f"{type(error).__name__}: {error}"
    px.wait_for_everyone()
    return result


# ---- the docs' hand-written cp loop (docs/long-sequences.md), against plain torch in one process ----
def one_process(model: torch.nn.Module, batches: list, loss_of) -> dict:
    """AdamW steps of `model` in one process, as torch/transformers docs write them: loss_of(model,
    *batch) is the batch's mean loss; each step's loss, clip_grad_norm_'s norm, the final weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in batches:
        loss = loss_of(model, *batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def at_cp2(build, batches: list, backward_of, loss_of) -> dict:
    """The same steps at cp 2 (ddp): backward_of(px, model, *batch) runs the batch's backward with
    num_items; px.step_loss and px.clip_grad_norm_'s norm per step, the final weights; rank 0 also
    returns one_process's run of a fresh build()."""
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", cp=2)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = px.prepare(model, optimizer)
    losses, norms = [], []
    for batch in batches:
        backward_of(px, model, *batch)
        norms.append(px.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(px.step_loss)
    result = {"losses": losses, "norms": norms, "weights": px.unwrap_model(model).state_dict()}
    if px.rank == 0:
        result["reference"] = one_process(build(), batches, loss_of)
    px.wait_for_everyone()
    return result


def _odd_rows(steps: int) -> list[tuple[torch.Tensor]]:
    """Rows of 16 tokens: 15 inputs, not a multiple of 2 x cp."""
    return [(tokens[:, :-1],) for (tokens,) in list(torch.utils.data.DataLoader(rows(), batch_size=4))[:steps]]


def _lm_mean_loss(model, tokens):
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=-100)


def _hand_written_backward(px, model, tokens) -> None:
    """docs/long-sequences.md's loop: px.shard_sequence(pad=True), a summed loss, px.backward with
    num_items the batch's target count."""
    targets = tokens[:, 1:]  # shifted before the cut
    num_items = (targets != -100).sum()  # the batch's count, before the cut
    inputs, targets = px.shard_sequence({"input_ids": tokens[:, :-1]}, targets, pad=True)
    logits = model(**inputs, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    px.backward(loss, num_items=num_items)


def train_hand_loop(steps: int = 3) -> dict:
    """The docs' hand-written cp loop at cp 2 against one process."""
    return at_cp2(tiny_llama, _odd_rows(steps), _hand_written_backward, _lm_mean_loss)


# ---- encoders under cp: ModernBERT's two-sided sliding window, BERT with padding -----------------
ENC_SEQ = 32


def tiny_encoder(kind: str) -> torch.nn.Module:
    """A masked-LM encoder from a tiny local config (fp32, no dropout)."""
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        attn_implementation="sdpa",
    )
    if kind == "modernbert":  # layer 0 global, layer 1 a window of 8 (4 each way)
        return tf.ModernBertForMaskedLM(
            tf.ModernBertConfig(
                **shape,
                local_attention=8,
                global_attn_every_n_layers=2,
                max_position_embeddings=2 * ENC_SEQ,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                cls_token_id=1,
                sep_token_id=2,
            )
        )
    return tf.BertForMaskedLM(
        tf.BertConfig(
            **shape, max_position_embeddings=2 * ENC_SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
    )


def encoder_batches(kind: str, steps: int, batch: int = 2) -> list[tuple[dict, torch.Tensor]]:
    """MLM batches: a quarter of the tokens are targets; BERT's rows end in 7 and 12 padding tokens."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch, ENC_SEQ), generator=g)
        labels = torch.where(torch.rand(batch, ENC_SEQ, generator=g) < 0.25, ids, torch.full_like(ids, -100))
        inputs = {"input_ids": ids}
        if kind == "bert":
            mask = torch.ones(batch, ENC_SEQ, dtype=torch.long)
            mask[0, -7:], mask[1, -12:] = 0, 0
            inputs["attention_mask"] = mask
            labels = labels.masked_fill(mask == 0, -100)
        out.append((inputs, labels))
    return out


def _mlm_loss(model, inputs, labels):
    return model(**inputs, labels=labels).loss  # transformers' own labels=


def _encoder_backward(px, model, inputs, labels) -> None:
    px.forward_backward(model, inputs, labels, summed_loss, num_items=(labels != -100).sum())


def train_encoder(kind: str, steps: int = 3) -> dict:
    """`steps` AdamW steps of the encoder at cp 2 through px.forward_backward against one process."""
    return at_cp2(lambda: tiny_encoder(kind), encoder_batches(kind, steps), _encoder_backward, _mlm_loss)
