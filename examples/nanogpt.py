"""A nanoGPT-style training script whose replicas sync with lowband (lowband.Sync).

    python -m torch.distributed.run --nproc-per-node 2 examples/nanogpt.py --data input.txt
    lowband launch --script examples/nanogpt.py --replicas 2 -- --data train.bin --algo diloco

The model, data, AdamW and cosine schedule are this script's own; lowband.Sync adds the
algorithm (ddp, diloco, streaming), the emulated link and the run directory that the dashboard,
`lowband report` and `lowband compare` read. --data: nanoGPT's uint16 token file (.bin) or any
text file read as bytes (default: the Python standard library's source)."""

import argparse, glob, math, os, sysconfig
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import lowband


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_layer=4, n_head=4, d_model=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        # the blocks are what lowband's streaming fragments are made of
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Stream:
    """Batches of random windows, from a seed of their own; the position is checkpointed."""
    def __init__(self, tokens, seed: int, batch: int, seq: int, device):
        self.tokens, self.seed, self.shape, self.device = tokens, seed, (batch, seq), device
        self.position = 0

    def next(self):
        (B, T), g = self.shape, torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        starts = torch.randint(len(self.tokens) - T - 1, (B,), generator=g).tolist()
        xy = torch.stack([torch.from_numpy(self.tokens[i:i + T + 1].astype(np.int64))
                          for i in starts])
        return xy[:, :-1].to(self.device), xy[:, 1:].to(self.device)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def load(path: str | None):
    if path and path.endswith(".bin"):
        return np.memmap(path, dtype=np.uint16, mode="r"), 50304  # GPT-2's vocabulary, padded
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
    files = [path] if path else sorted(glob.glob(stdlib))
    return np.frombuffer(b"".join(open(f, "rb").read() for f in files), dtype=np.uint8), 256


@torch.no_grad()
def evaluate(model, stream, batches: int = 4) -> float:
    model.eval()
    stream.position, losses = 0, []
    for _ in range(batches):
        x, y = stream.next()
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / batches


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="streaming", choices=["ddp", "diloco", "streaming"])
    for name, kind, default in [("data", str, None), ("steps", int, 200), ("lr", float, 1e-3),
                                ("batch-size", int, 8), ("seq-len", int, 128),
                                ("eval-every", int, 50)]:
        p.add_argument(f"--{name}", type=kind, default=default)
    for name, kind in [("sync-every", int), ("fragments", int), ("codec", str), ("run-dir", str),
                       ("link-bandwidth", str), ("checkpoint-every", int)]:  # lowband's options
        p.add_argument(f"--{name}", type=kind, dest="lowband_" + name.replace("-", "_"))
    p.add_argument("--resume", action="store_true", help="continue --run-dir's newest checkpoint")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))  # set by torchrun and by lowband launch
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available()
                          else "cpu")
    tokens, vocab = load(args.data)
    split = int(len(tokens) * 0.9)  # the last tenth is held out
    torch.manual_seed(0)
    model = GPT(vocab, args.seq_len).to(device)
    groups = [{"params": [q for q in model.parameters() if q.dim() >= 2], "weight_decay": 0.1},
              {"params": [q for q in model.parameters() if q.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    def lr_factor(s):  # a linear warm-up of 10 steps, then cosine down to a tenth
        done = min(max(s - 10, 0) / max(args.steps - 10, 1), 1.0)
        return min((s + 1) / 10, 0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    shape = (args.batch_size, args.seq_len, device)
    train = Stream(tokens[:split], 1 + rank, *shape)  # each rank its own stream
    held_out = Stream(tokens[split:], 0, *shape)
    options = {k[8:]: v for k, v in vars(args).items() if k[:8] == "lowband_" and v is not None}
    try:
        sync = lowband.Sync(model, optimizer, args.algo, steps=args.steps, seq_len=args.seq_len,
                            batch_size=args.batch_size, resume=args.resume,
                            state={"data": train, "sched": sched}, **options)
    except lowband.ConfigError as e:  # one sentence, no traceback
        raise SystemExit(f"nanogpt.py: {e}")
    for step in range(sync.start_step, sync.steps):
        x, y = train.next()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        sync.backward(loss)  # ddp averages the gradients here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sched.step()
        val = None
        if (step + 1) % args.eval_every == 0 and step + 1 < sync.steps:
            with sync.paused():  # not training time
                val = evaluate(model, held_out)
        sync.step(loss=loss, tokens=x.numel(), val_loss=val)
        if rank == 0 and (step + 1) % 10 == 0:
            shown = f", val {val:.4f}" if val is not None else ""
            print(f"step {step + 1}: loss {loss.item():.4f}{shown}", flush=True)
    with sync.paused():
        val = evaluate(model, held_out)
    summary = sync.finish(val_loss=val)  # summary.json; the summary on rank 0
    if summary is not None:
        print(f"{sync.run.root}: val loss {val:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, "
              f"outer link {summary['outer_wire_bytes']:,} bytes", flush=True)


if __name__ == "__main__":
    main()
