"""A PyTorch Lightning script whose replicas sync with lowband (LowbandCallback).

    lowband launch --script examples/lightning_train.py --replicas 2 -- --algo streaming
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --data input.txt

A LightningModule around lowband's own GPT, built from a preset (nothing is downloaded: its
weights start from the seed), trains on --data read as bytes (a text file, or lowband's
`builtin` corpus, the Python standard library's source; a nanoGPT .bin token file as uint16
ids). Lightning keeps its own loop, optimizer, schedule, validation and checkpoints;
LowbandStrategy makes each rank's Trainer train its replica alone on its share of the data, and
LowbandCallback adds diloco or streaming over the (emulated) outer link and writes lowband's run
directory, which the dashboard, `lowband report` and `lowband compare` read. Under `lowband
launch` the run directory is the launch's; under torchrun, --run-dir."""

import argparse
import math

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lowband import Config
from lowband.config import ConfigError
from lowband.data import load_tokens, vocab_needed
from lowband.integrations.lightning import LowbandCallback, LowbandStrategy
from lowband.models import build, lm_loss


class Windows(Dataset):
    """The corpus cut into windows of seq_len + 1 tokens: the inputs and, shifted, the labels."""

    def __init__(self, tokens, seq_len: int, windows: int | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.windows = min((len(tokens) - 1) // seq_len, windows or len(tokens))

    def __len__(self):
        return self.windows

    def __getitem__(self, i):
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        ids = torch.from_numpy(np.asarray(window).astype(np.int64))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class GPTModule(pl.LightningModule):
    def __init__(self, model: str, seq_len: int, vocab: int, lr: float, steps: int):
        super().__init__()
        self.gpt = build(Config(model=model, seq_len=seq_len), vocab)
        self.lr, self.steps = lr, steps

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.gpt, batch["input_ids"], batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.gpt, batch["input_ids"], batch["labels"]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95),
                                weight_decay=0.1)
        warmup = max(self.steps // 10, 1)  # then cosine to a tenth

        def factor(step):
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / self.steps, 1.0)))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="streaming", choices=["diloco", "streaming"])
    for name, kind, default in [("data", str, "builtin"), ("model", str, "micro"),
                                ("steps", int, 200), ("lr", float, 1e-3),
                                ("batch-size", int, 8), ("seq-len", int, 128),
                                ("eval-every", int, 50), ("eval-batches", int, 4),
                                ("output-dir", str, "lightning_out")]:
        p.add_argument(f"--{name}", type=kind, default=default)
    for name, kind in [("sync-every", int), ("fragments", int), ("codec", str), ("run-dir", str),
                       ("link-bandwidth", str)]:  # lowband's options
        p.add_argument(f"--{name}", type=kind, dest="lowband_" + name.replace("-", "_"))
    args = p.parse_args(argv)

    tokens = load_tokens(args.data)
    split = int(len(tokens) * 0.98)  # the last 2% is held out
    train = DataLoader(Windows(tokens[:split], args.seq_len), batch_size=args.batch_size,
                       shuffle=True)  # LowbandStrategy gives each replica its share
    val = DataLoader(Windows(tokens[split:], args.seq_len, args.eval_batches * args.batch_size),
                     batch_size=args.batch_size)
    torch.manual_seed(0)  # every replica starts from the same weights
    module = GPTModule(args.model, args.seq_len, vocab_needed(tokens), args.lr, args.steps)

    options = {k[8:]: v for k, v in vars(args).items() if k[:8] == "lowband_" and v is not None}
    try:
        callback = LowbandCallback(args.algo, **options)
        trainer = pl.Trainer(strategy=LowbandStrategy(), max_steps=args.steps,
                             val_check_interval=args.eval_every, check_val_every_n_epoch=None,
                             gradient_clip_val=1.0, default_root_dir=args.output_dir,
                             logger=False, enable_progress_bar=False, callbacks=[callback])
        trainer.fit(module, train, val)
    except ConfigError as e:  # one sentence, no traceback
        raise SystemExit(f"lightning_train.py: {e}")
    if callback.summary is not None:  # rank 0
        s = callback.summary
        print(f"lightning_train.py: {s['algorithm']}, {s['replicas']} replicas, "
              f"final loss {s['final_loss']:.3f}, outer link {s['outer_wire_bytes']:,} bytes")


if __name__ == "__main__":
    main()
