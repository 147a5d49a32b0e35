import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.telemetry import RunDir

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub


def lowband(*args, cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run the `lowband` CLI as a user would, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "lowband.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def train_in_one_job(*argvs) -> None:
    """Run `lowband train ARGV` for each ARGV in turn as its workers would (the CLI's own flag
    parser, then lowband.train.train), with the runs of one world size in one set of worker
    processes started once: a process's start-up (importing torch) is paid once, not once a run.
    A run that fails raises here, naming its flags."""
    import torch.multiprocessing as mp

    from lowband.flags import parse_train
    from lowband.launch.local import free_port

    by_world = {}
    for argv in argvs:
        argv = list(map(str, argv))
        by_world.setdefault(parse_train(argv)[0].world, []).append(argv)
    for world, runs in by_world.items():
        mp.start_processes(_train_worker, args=(world, free_port(), runs), nprocs=world,
                           start_method="spawn")


def join_local_job(rank: int, world: int, port: int) -> None:
    """In a spawned test worker: the variables `lowband train` sets for its workers
    (lowband/launch/local.py), so that lowband.train.train joins a job of `world` ranks on loopback."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _train_worker(rank: int, world: int, port: int, argvs: list) -> None:
    """One rank of train_in_one_job."""
    join_local_job(rank, world, port)
    import torch.distributed as dist

    from lowband.flags import parse_train
    from lowband.train import train

    for argv in argvs:
        try:
            cfg, resume = parse_train(argv)
            train(cfg, resume=resume)
        except Exception as e:
            raise RuntimeError(f"lowband train {' '.join(argv)} failed on rank {rank}") from e
    dist.destroy_process_group()


@pytest.fixture
def lowband_here(capsys, monkeypatch):
    """Run the `lowband` CLI's main in this process (from `cwd`): (exit status, stderr). For
    refusals made before any worker starts, without a process's ~2 s of importing torch."""

    def run(*args, cwd):
        from lowband.cli import main

        monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        return code, capsys.readouterr().err

    return run


@pytest.fixture
def train_run(tmp_path):
    """Run `lowband train` with the given flags into a fresh run directory; fail loudly."""

    def run(*args, name="run"):
        run_dir = tmp_path / name
        proc = lowband("train", "--no-progress", "--run-dir", run_dir, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return RunDir(run_dir)

    return run


@pytest.fixture
def train_runs(tmp_path):
    """train_run for several runs at once, name=[flags]: they train in one job a world size
    (train_in_one_job), so process start-up is paid once. Returns {name: RunDir}."""

    def run(**flags):
        train_in_one_job(*[["--no-progress", "--run-dir", tmp_path / name, *args]
                           for name, args in flags.items()])
        return {name: RunDir(tmp_path / name) for name in flags}

    return run


def hosts_for_a_test(hosts):
    """A fixture's body: set up test hosts (lowband.launch.hosts.TestHosts), skipping the test
    where they cannot be made; after it, kill what runs in them, remove them and check nothing is
    left."""
    try:
        hosts.setup()
    except RuntimeError as e:  # e.g. a container without CAP_NET_ADMIN or sch_tbf
        pytest.skip(f"cannot create the test hosts here: {e}")
    try:
        yield hosts
    finally:
        hosts.teardown()
        assert hosts.leftovers() == []


def reference_replicas(R: int, S: int, n_layer: int, seq: int, batch: int, lr: float, seed: int):
    """The float64 references' common start: R copies of lowband's GPT from one seeded
    initialisation, the R*S ranks' batches, and one AdamW per replica with the trainer's groups
    (weight decay 0.1 on matrices only, betas 0.9/0.95). Returns (init, models, data, opts)."""
    import torch

    from lowband.data import Batches, load_tokens
    from lowband.models.gpt import GPT, gpt_config

    torch.manual_seed(seed)
    mc = gpt_config("nano", n_layer=n_layer, seq_len=seq)
    init = GPT(mc).double()
    models = [GPT(mc).double() for _ in range(R)]
    for m in models:
        m.load_state_dict(init.state_dict())
    tokens = load_tokens("builtin")
    data = [Batches(tokens, rank=r, world=R * S, seq_len=seq, batch_size=batch, seed=seed,
                    val_fraction=0.02) for r in range(R * S)]
    opts = []
    for m in models:
        ps = list(m.parameters())
        opts.append(torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=lr, betas=(0.9, 0.95)))
    return init, models, data, opts


def outer_lr_of(run: RunDir) -> float:
    """The outer learning rate a run used, as its config.json records it (unset, --outer-lr
    follows R and H): the references compute with the run's own value, not a copy of a default."""
    import json

    return json.loads(run.config.read_text())["outer_lr"]


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """(tokenizer.json path, the tokenizers.Tokenizer, a 300 kB text) of a 512-token BPE trained
    here on the built-in corpus: nothing reaches a hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lowband.data import builtin_path

    root = tmp_path_factory.mktemp("tok")
    text = builtin_path().read_bytes()[:300_000].decode("utf-8", "replace")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator([text[i:i + 5000] for i in range(0, len(text), 5000)], trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json", t, text


def hf_config(root: Path, kind: str = "llama", layers: int = 4, vocab: int = 256) -> Path:
    """A tiny Hugging Face causal LM's directory (config.json only: lowband initialises it from
    the seed), built from a transformers config class, as a user's save_pretrained would."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if kind == "gpt2":
        c = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=256)
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
        c = cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=kind == "llama")
    out = root / f"{kind}-{layers}x64-v{vocab}"
    c.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    """A 4-layer, 64-wide Llama (GQA, tied embeddings, byte vocabulary) as a config directory."""
    return hf_config(tmp_path_factory.mktemp("hf"))
