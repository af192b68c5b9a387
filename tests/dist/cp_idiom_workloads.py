"""transformers' own idioms under cp 2 against the same loop in plain transformers in one process
(no phalanx): `labels=` (the model shifts them), a plain token tensor (the model makes its own
positions), and a family whose attention takes more than a mask (Gemma2's softcap). Each case: a few
AdamW steps, loss and grad norm (torch's clip_grad_norm_) per step, the final weights."""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ, STEPS, BATCH = 64, 16, 3, 4


def tiny_lm(family: str) -> torch.nn.Module:
    """A 2-layer causal LM built locally (same seed: same weights); Gemma2 with a small softcap so it
    bites; LoRA adapters (random B, so they matter from step 1) on the Llama."""
    import transformers

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
    )
    if family == "gemma2":
        config = transformers.Gemma2Config(
            **shape,
            head_dim=8,
            attn_logit_softcapping=1.0,
            sliding_window=6,
            initializer_range=0.1,
            query_pre_attn_scalar=8,
            attn_implementation="eager",
        )
        return transformers.Gemma2ForCausalLM(config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attn_implementation="sdpa"))
    if family == "llama-lora":  # a PEFT wrapper: its forward takes (*args, **kwargs)
        import peft

        torch.manual_seed(2)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(model, config)
    return model


def token_rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def logits_loss(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())


def one_process(family: str, idiom: str) -> dict:
    """The loop as transformers' docs write it, one process, no phalanx."""
    model = tiny_lm(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for tokens in token_rows():
        if idiom == "labels":
            loss = model(input_ids=tokens[:, :SEQ], labels=tokens[:, :SEQ]).loss
        else:  # a plain token tensor: the model numbers the positions itself
            loss = logits_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        whole = model(input_ids=token_rows()[0][:, :SEQ]).logits
    return {"losses": losses, "norms": norms, "weights": model.state_dict(), "whole_row": whole}


def _cp_mean(loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def under_cp(px, family: str, idiom: str, path: str) -> dict:
    """The same loop at cp 2: through px.forward_backward ("fb") or by hand (px.shard_sequence)."""
    model = tiny_lm(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = px.prepare(model, optimizer)
    losses, norms = [], []
    for tokens in token_rows():
        if idiom == "labels":
            batch = {"input_ids": tokens[:, :SEQ], "labels": tokens[:, :SEQ]}
            if path == "fb":
                loss = px.forward_backward(model, batch, None, lambda out, _: out.loss).item()
            else:
                inputs, _ = px.shard_sequence(batch)
                out = model(**inputs)
                px.backward(out.loss)
                loss = _cp_mean(out.loss)
        elif path == "fb":
            loss = px.forward_backward(model, tokens[:, :-1], tokens[:, 1:], logits_loss).item()
        else:
            x, y = px.shard_sequence(tokens[:, :-1], tokens[:, 1:])
            step_loss = logits_loss(model(x), y)
            px.backward(step_loss)
            loss = _cp_mean(step_loss)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    with torch.no_grad():  # an evaluation of whole rows after training (no cut)
        whole = px.unwrap_model(model)(input_ids=token_rows()[0][:, :SEQ]).logits
    return {"losses": losses, "norms": norms, "weights": px.unwrap_model(model).state_dict(), "whole_row": whole}


def compare(got: dict, want: dict) -> dict:
    """Largest relative differences: per-step loss and grad norm, final weights, a whole-row eval."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

    weights = max(rel(got["weights"][name].float(), w.float()) for name, w in want["weights"].items())
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)),
        "norm": max(abs(a - b) / abs(b) for a, b in zip(got["norms"], want["norms"], strict=True)),
        "weights": weights,
        "whole_row": rel(got["whole_row"], want["whole_row"]),
        "losses": (got["losses"], want["losses"]),
        "norms": (got["norms"], want["norms"]),
    }


def train_idioms(cases: list[tuple[str, str, str]]) -> dict:
    """Each (family, idiom, path) at cp 2 against one process; an error is returned as its message."""
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", cp=2)
    result: dict = {}
    for family, idiom, path in cases:
        try:
            result[(family, idiom, path)] = compare(under_cp(px, family, idiom, path), one_process(family, idiom))
        except (ValueError, RuntimeError) as error:  # the test asserts on the message
            result[(family, idiom, path)] = f"{type(error).__name__}: {error}"
    px.wait_for_everyone()
    return result


def refusals() -> dict:
    """A family whose attention takes an argument the cut cannot apply is refused at prepare."""
    import transformers
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", cp=2)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"],
    )
    try:
        px.prepare(transformers.GptOssForCausalLM(config))
        return {"gpt_oss": "prepared"}
    except ValueError as error:
        return {"gpt_oss": str(error)}
