"""A transformers.Trainer run in the shape of Ray's Transformers guide (a tiny BERT from a config, synthetic
tokens), run unchanged by Ray 2.60 and by `outlast run`: python transformers_example.py STORAGE_DIR"""
import os
import sys
import tempfile

import torch
import transformers
from torch.utils.data import Dataset

import ray.train.huggingface.transformers
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


class Tokens(Dataset):
    def __len__(self):
        return 128

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids % 2}


def train_func():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    model = transformers.BertForTokenClassification(config)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), num_train_epochs=2,
                                          per_device_train_batch_size=8, save_strategy="epoch", logging_steps=4,
                                          report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[ray.train.huggingface.transformers.RayTrainReportCallback()])
    trainer = ray.train.huggingface.transformers.prepare_trainer(trainer)
    trainer.train()


result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name="transformers", storage_path=sys.argv[1])).fit()
with result.checkpoint.as_directory() as d:
    assert os.path.isdir(os.path.join(d, "checkpoint")), os.listdir(d)
print("ok", result.metrics.get("epoch"))
