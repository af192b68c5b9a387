"""The HF Trainer on a tiny BERT classifier built from a config (no download), as the seeds' text
classification: TrainingArguments with a per-device batch, trainer.train().

    phalanx run --nproc-per-node 2 [--mixed-precision bf16] hf_trainer.py OUT_DIR
"""

import os
import sys

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from seed_data import report

SEEN = []


class Reviews(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        SEEN.append(i)
        return {"input_ids": torch.tensor([1, i % 20 + 3, 2]), "labels": torch.tensor(i % 2)}


def main(out_dir):
    config = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=8,
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Reviews())
    trainer.train()
    report(
        out_dir,
        "hf_trainer",
        int(os.environ["RANK"]),
        seen=[SEEN],
        world_size=args.world_size,
        steps=trainer.state.global_step,
        mixed_precision=trainer.accelerator.mixed_precision,
    )


if __name__ == "__main__":
    main(sys.argv[1])
