"""Causal-LM fine-tuning of a transformers model on phalanx, optionally with LoRA (peft), under any strategy.

    python examples/finetune_llm.py --tiny --steps 30                          # one process, a tiny Llama
    phalanx run --nproc-per-node 2 --strategy zero3 examples/finetune_llm.py --tiny --lora 8 --save out/tiny
    phalanx run --nproc-per-node 4 --strategy zero3 --mixed-precision bf16 \\
        examples/finetune_llm.py --model ./Llama-3.2-1B --lora 16 --steps 500 --save out/llama-lora

Model: `--model DIR`, a local transformers model directory (config, tokenizer, safetensors weights),
or `--tiny`: a small Llama made from a config and a byte-level BPE tokenizer trained on the corpus,
saved as such a directory in the run directory (nothing is downloaded), then used like `--model`.
The model is built on the meta device (`px.init_module()`: under zero2/zero3/hsdp nothing is
allocated), prepared (each rank allocates only its shards), and the pretrained weights are read
with `px.load_model`, each rank reading only its own slices of the safetensors files.

Data: Python's reference documentation as it ships inside the interpreter (`pydoc_data.topics`),
one paragraph per sample, or `--data FILE` (paragraphs separated by blank lines). Batches are
padded; labels are -100 at the padding. The loss is summed over each batch's target tokens and
given with their count, `px.backward(loss, num_items=tokens)`: every optimizer step averages over
all target tokens of the global batch, whatever the ranks, accumulation and padding.

`--tie-embeddings` (with --tiny): the output projection shares the input embedding's weight, as in
Llama-3.2-1B and Qwen2.5. Under `--pp N` the loop trains with `px.forward_backward` and evaluates with
`px.forward` (the pipeline takes the token ids alone), with the same token-weighted loss.

`--lora R`: rank-R adapters on the attention and MLP projections; the base weights are frozen and
the optimizer holds only the adapters. Under zero3 each decoder layer is one sharding unit holding
its frozen weights and its adapters. `--save DIR` writes a directory `AutoModelForCausalLM.from_pretrained`
loads, adapters merged into the weights (`--keep-adapters`: the adapters alone, with the base
model's path in their config, which from_pretrained also loads). Checkpoints and resume as for any
model: `--checkpoint-dir DIR` (phalanx's setting) with `--checkpoint-every N`.

`--optimizer muon`: torch's Muon on the decoder layers' matrices (adapters too, under `--lora`), with
its learning rate matched to AdamW's RMS, and AdamW on the rest (embeddings, head, norms), as Muon is
meant to be used. Muon orthogonalises each whole matrix; under zero1/zero2/zero3/hsdp/tp phalanx
hands every matrix whole to one owner rank (docs/optimizers.md), so any strategy trains as one
process would:

    phalanx run --nproc-per-node 2 --strategy zero3 examples/finetune_llm.py --tiny --optimizer muon

`--pack`: paragraphs packed end to end into rows of exactly --seq-len tokens, position_ids restarting
at each paragraph (transformers' packing: block-diagonal causal attention, no padding); the target
that would cross into the next paragraph is ignored. `--cp N`: context parallel, each row's sequence
cut over N processes (docs/long-sequences.md); with --pack the loop uses `px.forward_backward`, which
cuts inputs and targets, and stays equal to one process:

    phalanx run --nproc-per-node 2 examples/finetune_llm.py --tiny --cp 2 --seq-len 256 --pack

`--moe` (with --tiny): a tiny Qwen3-MoE (4 experts, top 2) instead of the Llama, for expert parallel
(phalanx's `--ep N`, docs/moe.md): each of the 2 processes holds half of every layer's experts:

    phalanx run --nproc-per-node 2 --ep 2 examples/finetune_llm.py --tiny --moe
"""

import argparse
import contextlib
import math
import os
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORE = -100


def load_paragraphs(path=None, limit=None):
    """Paragraphs of --data FILE, else of the Python reference documentation shipped with Python."""
    if path:
        with open(path, encoding="utf-8") as fp:
            text = fp.read()
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[name] for name in sorted(topics))
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    paragraphs = [p for p in paragraphs if len(p) >= 40]
    return paragraphs[:limit] if limit else paragraphs


def make_tiny_model(paragraphs, directory, seed=0, tie_embeddings=False, moe=False):
    """A 2-layer Llama and a 512-token byte-level BPE tokenizer trained on the corpus, saved to `directory`;
    `tie_embeddings`: the output projection shares the input embedding's weight (as in Llama-3.2-1B, Qwen2.5);
    `moe`: a 2-layer Qwen3-MoE instead, 4 experts per layer, each token through its router's top 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        paragraphs,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if moe:
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **shape,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                intermediate_size=128,
            )
        )
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=128))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def add_lora(model, rank):
    """Rank-`rank` LoRA adapters on the attention and MLP projections; everything else frozen."""
    from peft import LoraConfig, get_peft_model

    names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})
    targets = [p for p in PROJECTIONS if p in names]
    if not targets:
        raise ValueError(
            f"--lora {rank}: the model has no attention or MLP projection among the Linear layers "
            f"looked for ({', '.join(PROJECTIONS)}); its Linear layers are named: "
            f"{', '.join(names) or 'none'}. HINT: fine-tune it without --lora, or add its projection "
            "names to PROJECTIONS"
        )
    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    )


def block_classes(model_dir):
    """The model's decoder-layer class names (transformers' `_no_split_modules`): one sharding unit each."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    classes = [getattr(transformers, name, None) for name in config.architectures or []]
    return {name for cls in classes if cls is not None for name in (cls._no_split_modules or [])}


def pack(samples, seq_len):
    """Rows of seq_len + 1 token ids and their positions (restarting at each paragraph), end to end."""
    ids = [t for s in samples for t in s]
    positions = [p for s in samples for p in range(len(s))]
    width = seq_len + 1
    return [
        (torch.tensor(ids[i : i + width]), torch.tensor(positions[i : i + width]))
        for i in range(0, len(ids) - width + 1, width)
    ]


def packed_batch(rows):
    """Inputs (positions global within the row, so a cut keeps them) and shifted targets of packed rows."""
    ids, positions = (torch.stack(column) for column in zip(*rows))
    targets = ids[:, 1:].masked_fill(positions[:, 1:] == 0, IGNORE)  # never predict across paragraphs
    return {"input_ids": ids[:, :-1], "position_ids": positions[:, :-1], "use_cache": False}, targets


def summed_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def collate(pad_id):
    def pad(samples):
        width = max(len(s) for s in samples)
        input_ids = torch.full((len(samples), width), pad_id)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            input_ids[i, : len(s)] = torch.tensor(s)
            attention_mask[i, : len(s)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    return pad


def losses_of(logits, labels):
    """Per-sample sums of the next-token loss over the target tokens, and each sample's target count."""
    targets = labels[:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(targets.shape)
    return losses.sum(1), (targets != IGNORE).sum(1)


def token_losses(px, model, batch):
    """`losses_of` the model's logits for the batch. Under pp the pipeline takes the token ids alone:
    with right padding and causal attention, the mask changes no target token's logits."""
    if px.plan.pp > 1:
        return losses_of(px.forward(model, batch["input_ids"]).logits, batch["labels"])
    return losses_of(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    )


def pipeline_step(px, model, batch):
    """Under pp: one pipeline step on the batch with the token-weighted loss Σ loss / Σ tokens over
    the global batch (the data-parallel ranks' tokens counted first; the pipeline's loss is the mean
    over its microbatches and DDP averages over the data-parallel ranks, hence the factors)."""
    tokens = px.reduce((batch["labels"][:, 1:] != IGNORE).sum().float(), "sum")
    scale = px.config.pp_microbatches or 2 * px.plan.pp  # phalanx's default: 2 microbatches per stage
    scale *= px.dp_size / tokens

    def loss_fn(output, labels):  # the model's output object, as in one process
        return losses_of(output.logits, labels)[0].sum() * scale

    return px.forward_backward(model, batch["input_ids"], batch["labels"], loss_fn)


@torch.no_grad()
def evaluate(px, model, loader):
    """Token-weighted mean loss over the whole eval set (each sample once) and its perplexity."""
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        sums, counts = px.gather_for_metrics(token_losses(px, model, batch))
        total, count = total + sums.double().sum().item(), count + counts.sum().item()
    model.train()
    return total / count, math.exp(total / count)


def save(px, model, config, tokenizer, args, base_dir, out):
    """Full weights gathered on the main process, put in a CPU copy of the model: LoRA merged into
    the weights (or, --keep-adapters, the adapters saved alone), then `save_pretrained`."""
    from transformers import AutoModelForCausalLM

    state = px.get_state_dict(model)  # every rank takes part; the main process gets the full weights
    if px.is_main_process:
        cpu = AutoModelForCausalLM.from_config(config)
        if args.lora:
            cpu = add_lora(cpu, args.lora)
            cpu.peft_config["default"].base_model_name_or_path = os.path.abspath(base_dir)
        cpu.load_state_dict(state)
        if args.lora and not args.keep_adapters:
            cpu = cpu.merge_and_unload()
        cpu.save_pretrained(out)
        tokenizer.save_pretrained(out)
    px.wait_for_everyone()


def make_optimizers(model, name, lr):
    """AdamW on every trainable weight; or Muon on the decoder layers' 2-D weights (their RMS matched
    to AdamW's, so one learning rate serves both) and AdamW on the embeddings, head, norms and biases."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return [torch.optim.AdamW([p for _, p in trainable], lr=lr, weight_decay=0.0)]
    matrices = [p for n, p in trainable if p.dim() == 2 and ".layers." in f".{n}"]
    chosen = {id(p) for p in matrices}
    rest = [p for _, p in trainable if id(p) not in chosen]
    muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    return [muon] + ([torch.optim.AdamW(rest, lr=lr, weight_decay=0.0)] if rest else [])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="local transformers model directory")
    source.add_argument("--tiny", action="store_true", help="a small Llama made here (no download), for tests and CPUs")
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="text file, paragraphs separated by blank lines (default: Python's reference documentation)",
    )
    parser.add_argument("--limit", type=int, help="use only the first N paragraphs (quick runs)")
    parser.add_argument("--lora", type=int, metavar="R", help="train rank-R LoRA adapters instead of every weight")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="--tiny: a mixture-of-experts model (Qwen3-MoE, 4 experts, top 2), for expert parallel (phalanx's --ep)",
    )
    parser.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="--tiny: the output projection shares the input embedding's weight",
    )
    parser.add_argument("--keep-adapters", action="store_true", help="--save writes the adapters, not merged weights")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample at most")
    parser.add_argument("--lr", type=float, help="learning rate (default 1e-3 with --tiny, else 2e-4)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--checkpoint-every", type=int, metavar="N", help="px.save_state() every N steps (needs --checkpoint-dir)"
    )
    parser.add_argument("--save", metavar="DIR", help="write a from_pretrained directory after training")
    parser.add_argument("--pack", action="store_true", help="pack paragraphs into full rows of --seq-len tokens")
    parser.add_argument("--cp", type=int, help="context-parallel degree (phalanx's cp setting)")
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: Muon on the decoder layers' matrices, AdamW on the rest",
    )
    args = parser.parse_args()

    paragraphs = load_paragraphs(args.data, args.limit)
    base_dir = args.model
    blocks = block_classes(base_dir) if base_dir else {"Qwen3MoeDecoderLayer" if args.moe else "LlamaDecoderLayer"}
    # zero2/zero3/hsdp: each decoder layer is a sharding unit (frozen weights and adapters together)
    px = Phalanx(strategy_options={"shard_modules": lambda name, module: type(module).__name__ in blocks}, cp=args.cp)
    if args.tiny:
        base_dir = os.path.join(px.run_dir, "tiny-moe" if args.moe else "tiny-llama")
        with px.main_process_first():
            if px.is_main_process:
                make_tiny_model(paragraphs, base_dir, tie_embeddings=args.tie_embeddings, moe=args.moe)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = [ids[: args.seq_len] for ids in tokenizer(paragraphs)["input_ids"] if len(ids) >= 2]
    train, held_out = [s for i, s in enumerate(samples) if i % 10], samples[::10]

    config = AutoConfig.from_pretrained(base_dir)
    # A mixture of experts is read by from_pretrained, whole on every rank (expert parallel takes each
    # rank's experts from the materialized weights, and transformers turns the per-expert tensors of its
    # files into the fused experts its model holds); any other model is built on the meta device under
    # zero2/zero3/hsdp (nothing allocated until prepare) and read by px.load_model after prepare.
    moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    with contextlib.nullcontext() if moe else px.init_module():
        model = (AutoModelForCausalLM.from_pretrained if moe else AutoModelForCausalLM.from_config)(
            base_dir if moe else config
        )
        if args.lora:
            model = add_lora(model, args.lora)
    lr = args.lr or (1e-3 if args.tiny else 2e-4)
    optimizers = make_optimizers(model, args.optimizer, lr)
    optimizer_names = " + ".join(type(o).__name__ for o in optimizers)
    train_loader = DataLoader(
        pack(train, args.seq_len) if args.pack else train,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=packed_batch if args.pack else collate(pad_id),
    )
    eval_loader = DataLoader(held_out, batch_size=args.batch_size, collate_fn=collate(pad_id))
    model, *optimizers, train_loader, eval_loader = px.prepare(model, *optimizers, train_loader, eval_loader)
    if not moe:
        px.load_model(model, base_dir)  # each rank reads its own slices of the safetensors files
    with torch.no_grad():  # LoRA's B starts at zero: the adapted model starts as the pretrained one
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.zero_()
    resumed = px.config.checkpoint_dir is not None and px.load_state()  # resume from --checkpoint-dir
    trainable = sum(p.numel() for p in px.unwrap_model(model).parameters() if p.requires_grad)
    px.print(
        f"{len(train)} training and {len(held_out)} held-out paragraphs; strategy {px.strategy_name}, "
        f"{px.world_size} process(es){f', cp {px.cp_size}' if px.cp_size > 1 else ''}{f', ep {px.plan.ep}' if px.plan.ep > 1 else ''}; training {'LoRA adapters' if args.lora else 'every weight'} "
        f"({trainable:,} parameters) with {optimizer_names}"
        + (f"; resumed at step {px.global_step}" if resumed else "")
    )

    before = evaluate(px, model, eval_loader)
    px.print(f"before: eval loss {before[0]:.4f}, perplexity {before[1]:.2f}")
    model.train()
    while px.global_step < args.steps:
        for batch in px.progress(train_loader, desc=f"step {px.global_step}"):
            with px.accumulate(model):
                if px.plan.pp > 1:
                    step_loss = px.reduce(pipeline_step(px, model, batch), "mean")
                elif args.pack:  # cut along the sequence under cp; Σ loss / Σ tokens over the global batch
                    inputs, targets = batch
                    px.forward_backward(model, inputs, targets, summed_loss, num_items=(targets != IGNORE).sum())
                else:
                    sums, counts = token_losses(px, model, batch)
                    px.backward(sums.sum(), num_items=counts.sum())  # Σ loss / Σ tokens over the global batch
                px.clip_grad_norm_(model.parameters(), 1.0)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            if not px.sync_gradients:
                continue
            step = px.global_step
            if step % args.log_every == 0 or step == args.steps:
                loss = px.step_loss if px.plan.pp == 1 else step_loss.item()
                px.log({"loss": loss}, step=step)  # the same global token-weighted mean
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                px.save_state()
            if step >= args.steps:
                break
    after = evaluate(px, model, eval_loader)
    px.print(
        f"after {px.global_step} steps: eval loss {after[0]:.4f}, perplexity {after[1]:.2f} "
        f"(was {before[0]:.4f}, {before[1]:.2f})"
    )
    if args.save:
        save(px, model, config, tokenizer, args, base_dir, args.save)
        px.print(f"saved to {args.save}: AutoModelForCausalLM.from_pretrained({args.save!r}) loads it")


if __name__ == "__main__":
    main()
