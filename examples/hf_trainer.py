"""A Hugging Face Trainer script whose replicas sync with lowband (LowbandCallback).

    lowband launch --script examples/hf_trainer.py --replicas 2 -- --algo streaming
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --data input.txt

A small Llama built from a LlamaConfig (nothing is downloaded: its weights start from the seed)
trains on --data read as bytes (a text file, or lowband's `builtin` corpus, the Python standard
library's source; a nanoGPT .bin token file as uint16 ids). The Trainer keeps its own loop,
optimizer, schedule and evaluation; LowbandTrainingArguments makes each rank's Trainer train its
replica alone, and LowbandCallback adds diloco or streaming over the (emulated) outer link and
writes lowband's run directory, which the dashboard, `lowband report` and `lowband compare`
read. Under `lowband launch` the run directory is the launch's; under torchrun, --run-dir."""

import argparse

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer

from lowband.config import ConfigError
from lowband.data import load_tokens, vocab_needed
from lowband.integrations.transformers import LowbandCallback, LowbandTrainingArguments


class Windows(torch.utils.data.Dataset):
    """The corpus cut into windows of seq_len tokens, each its own labels (the model shifts)."""

    def __init__(self, tokens, seq_len: int, windows: int | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.windows = min(len(tokens) // seq_len, windows or len(tokens))

    def __len__(self):
        return self.windows

    def __getitem__(self, i):
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        ids = torch.from_numpy(np.asarray(window).astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="streaming", choices=["diloco", "streaming"])
    for name, kind, default in [("data", str, "builtin"), ("steps", int, 200),
                                ("lr", float, 1e-3), ("batch-size", int, 8),
                                ("seq-len", int, 128), ("layers", int, 4), ("width", int, 128),
                                ("eval-every", int, 50), ("eval-batches", int, 4),
                                ("output-dir", str, "hf_trainer_out")]:
        p.add_argument(f"--{name}", type=kind, default=default)
    for name, kind in [("sync-every", int), ("fragments", int), ("codec", str), ("run-dir", str),
                       ("link-bandwidth", str)]:  # lowband's options
        p.add_argument(f"--{name}", type=kind, dest="lowband_" + name.replace("-", "_"))
    args = p.parse_args(argv)

    tokens = load_tokens(args.data)
    split = int(len(tokens) * 0.98)  # the last 2% is held out
    train_set = Windows(tokens[:split], args.seq_len)
    val_set = Windows(tokens[split:], args.seq_len, args.eval_batches * args.batch_size)
    config = LlamaConfig(vocab_size=vocab_needed(tokens), hidden_size=args.width,
                         intermediate_size=4 * args.width, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=True)
    torch.manual_seed(0)  # every replica starts from the same weights
    model = LlamaForCausalLM(config)

    # one rank's Trainer: its own replica, its own data order (the seed plus its rank)
    training = LowbandTrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        lr_scheduler_type="cosine", warmup_steps=min(10, args.steps // 10), weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, eval_strategy="steps", eval_steps=args.eval_every,
        logging_steps=10, save_strategy="no", report_to="none")
    options = {k[8:]: v for k, v in vars(args).items() if k[:8] == "lowband_" and v is not None}
    try:
        callback = LowbandCallback(args.algo, **options)
        trainer = Trainer(model=model, args=training, train_dataset=train_set,
                          eval_dataset=val_set, callbacks=[callback])
        trainer.train()
    except ConfigError as e:  # one sentence, no traceback
        raise SystemExit(f"hf_trainer.py: {e}")
    if callback.summary is not None:  # rank 0
        s = callback.summary
        print(f"hf_trainer.py: {s['algorithm']}, {s['replicas']} replicas, "
              f"final loss {s['final_loss']:.3f}, outer link {s['outer_wire_bytes']:,} bytes")


if __name__ == "__main__":
    main()
