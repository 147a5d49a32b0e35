"""The Hugging Face Trainer with lowband's streaming (lowband.integrations.transformers): a tiny
Llama trained by Trainer + LowbandCallback under lowband.launch(script=...) with R=2 (each
replica's Trainer alone: their weights differ at every step, the outer link carries exactly
streaming's syncs, the inner link nothing; the loss falls; `lowband report` reads the run), a
run lost and resumed equal to the whole run, and what the callback refuses, each in one sentence
before anything is written."""

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torchx")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import (AutoConfig, AutoModelForCausalLM, TrainerControl,  # noqa: E402
                          TrainerState, TrainingArguments)

import lowband  # noqa: E402
from lowband.config import ConfigError  # noqa: E402
from lowband.integrations.transformers import (LowbandCallback,  # noqa: E402
                                               LowbandTrainingArguments)
from lowband.launch.local import free_port  # noqa: E402
from lowband.telemetry import read_events  # noqa: E402

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

SCRIPT = textwrap.dedent('''
    """A user's Trainer script: its own model and data, lowband's streaming through a callback.
    launched: one run (the run directory lowband.launch's); resume: under torchrun, a whole run,
    then one lost after step 6 and resumed from its checkpoints of step 4."""
    import hashlib, json, os, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback
    from lowband.data import load_tokens
    from lowband.integrations.transformers import LowbandCallback, LowbandTrainingArguments

    hf_dir, out, mode = sys.argv[1:]
    text = torch.from_numpy(load_tokens("builtin")[:100_000].astype("int64"))
    rows = text[: 32 * (len(text) // 32)].view(-1, 32)
    train_set = [{"input_ids": r, "labels": r} for r in rows[:-64]]
    val_set = [{"input_ids": r, "labels": r} for r in rows[-64:]]


    class Digests(TrainerCallback):  # this replica's weights after each step
        def __init__(self, path):
            self.path = path

        def on_step_end(self, args, state, control, model=None, **kwargs):
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            with open(f"{self.path}{os.environ['RANK']}.txt", "a") as f:
                f.write(hashlib.sha256(flat.numpy().tobytes()).hexdigest() + "\\n")


    class Lost(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                raise RuntimeError("lost after step 6")


    def train(tag, lost=False, resume=False, save="no", accum=1, **options):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
        # use_cpu: accelerate would make a gloo DDP job of both processes, but for these arguments
        args = LowbandTrainingArguments(output_dir=f"{out}/{tag}", max_steps=8, learning_rate=3e-3,
                                        per_device_train_batch_size=8 // accum, use_cpu=True,
                                        gradient_accumulation_steps=accum, logging_steps=1,
                                        eval_strategy="steps", eval_steps=4,
                                        save_strategy=save, save_steps=4, report_to="none")
        callback = LowbandCallback("streaming", link_bandwidth="", resume=resume, **options)
        trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=val_set,
                          callbacks=[callback, Digests(f"{out}/{tag}")] + [Lost()] * lost)
        try:
            trainer.train(resume_from_checkpoint=resume or None)
        except RuntimeError:
            torch.distributed.barrier()  # (rank 0's Trainer has saved its checkpoint)
        return callback.summary, args, trainer


    if mode == "launched":
        summary, args, trainer = train("one", accum=2, sync_every=2, fragments=2, overlap=0,
                                       codec="fp32")
        if summary is not None:
            print("TRAINED", summary["steps"], args.world_size, args.data_seed)
            print("LOGGED", json.dumps([h["loss"] for h in trainer.state.log_history
                                        if "loss" in h]))
    else:
        kw = dict(sync_every=4, fragments=2, overlap=1, codec="fp4-e3m0", checkpoint_every=4,
                  save="steps")
        whole, *_ = train("whole", run_dir=f"{out}/whole", **kw)
        train("resumed", run_dir=f"{out}/resumed", lost=True, **kw)
        resumed, *_ = train("resumed", run_dir=f"{out}/resumed", resume=True, **kw)
        if whole is not None:
            print("SUMMARIES", json.dumps([whole, resumed]))
''')


def test_trainer_trains_streaming_replicas_apart(llama, tmp_path, monkeypatch, lowband_here):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "hf_train.py").write_text(SCRIPT)
    h = lowband.launch(script="hf_train.py", script_args=[llama, tmp_path / "out", "launched"],
                       replicas=2, shards=1, run_dir=tmp_path / "run")
    assert h.wait(timeout=150) == "succeeded", h.logs()
    assert "TRAINED 8 1 42" in h.logs()  # rank 0: a Trainer of one process, its seed's data order
    summary = h.summary()
    assert (summary["algorithm"], summary["replicas"], summary["shards"]) == ("streaming", 2, 1)
    assert summary["steps_run_per_replica"] == [8, 8] and summary["tokens"] == 2 * 8 * 8 * 32
    # replicas apart: no step's weights are the same on both (DDP would make every one equal)
    w0, w1 = ((tmp_path / "out" / f"one{r}.txt").read_text().split() for r in (0, 1))
    assert len(w0) == len(w1) == 8 and all(a != b for a, b in zip(w0, w1))
    # the outer link: each of the 2 fragments synced every 2 steps, 4 times, an fp32 all-reduce
    # of 2 ranks sending its 4 bytes a parameter, and beside each of those 8 syncs the guard's
    # norms (algorithms/guard.py: 4 float64s a rank, sent to the other); nothing inside a replica
    n_params = json.loads((tmp_path / "run" / "config.json").read_text())["meta"]["n_params"]
    assert summary["outer_wire_bytes"] == 2 * 4 * 4 * n_params + 2 * 8 * 32
    assert summary["inner_wire_bytes"] == 0
    steps = [e for e in read_events(tmp_path / "run", ("step",)) if e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 9))
    # the step's loss: the Trainer's own (its micro-batches' shares of the mean, 2 a step)
    logged = json.loads(h.logs().split("LOGGED", 1)[1].splitlines()[0])
    assert logged == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    assert summary["final_loss"] < steps[0]["loss"] - 0.3, (steps[0]["loss"], summary)
    evals = [e for e in read_events(tmp_path / "run", ("eval",)) if e["rank"] == 0]
    assert [e["step"] for e in evals] == [4, 8] and evals[1]["val_loss"] < evals[0]["val_loss"]
    code, err = lowband_here("report", tmp_path / "run", "-o", tmp_path / "report.html",
                             cwd=tmp_path)
    assert code == 0 and (tmp_path / "report.html").stat().st_size > 0, err


def test_a_resumed_trainer_run_equals_the_whole_run(llama, tmp_path):
    """Lost after step 6, resumed from step 4 (the Trainer's checkpoint-4 and lowband's, with
    streaming fp4 and an exchange in flight): every step's weights after it, the summary's
    tokens, bytes and losses equal the run never lost, bitwise."""
    (tmp_path / "hf_train.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "hf_train.py", llama,
           tmp_path, "resume"]
    proc = subprocess.run(list(map(str, cmd)), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    whole, resumed = json.loads(proc.stdout.split("SUMMARIES", 1)[1].splitlines()[0])
    for key in ("steps_run_per_replica", "tokens", "outer_wire_bytes", "final_loss",
                "final_val_loss"):
        assert whole[key] == resumed[key], key
    assert whole["steps_run_per_replica"] == [8, 8]
    for r in (0, 1):
        w, again = ((tmp_path / f"{tag}{r}.txt").read_text().split()
                    for tag in ("whole", "resumed"))
        assert len(w) == 8 and len(again) == 6 + 4  # the lost attempt's 6 steps, then 5 to 8
        assert again[:6] == w[:6] and again[6:] == w[4:]


# -- what the callback refuses ---------------------------------------------------------------------

def _one_sentence(message: str) -> bool:
    return "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("algo, kwargs, says", [
    ("ddp", {}, "use the Trainer's own DDP (torchrun without the callback)"),
    ("edit", {}, "shards the model with FSDP2"),
    ("nope", {}, "LowbandCallback runs algo='diloco' or 'streaming', not 'nope'."),
    ("streaming", {"local_steps": "adaptive"}, "LowbandCallback runs local_steps='fixed'"),
    ("streaming", {"steps": 10}, "steps= is the Trainer's max_steps (or num_train_epochs) here"),
    ("diloco", {"grad_accum": 2}, "is the Trainer's gradient_accumulation_steps here"),
])
def test_the_callback_refuses_what_it_cannot_run(algo, kwargs, says):
    with pytest.raises(ConfigError) as e:
        LowbandCallback(algo, **kwargs)
    assert says in str(e.value) and _one_sentence(str(e.value)), str(e.value)


def _begin(callback, args, model):
    optimizer = torch.optim.AdamW(model.parameters())
    callback.on_train_begin(args, TrainerState(max_steps=4), TrainerControl(), model=model,
                            optimizer=optimizer)


def test_the_callback_refuses_a_data_parallel_trainer_and_shards(llama, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = TrainingArguments(output_dir=tmp_path / "hf", report_to="none")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a job of two processes, as torchrun starts it
    with pytest.raises(ConfigError) as e:
        _begin(LowbandCallback("diloco", run_dir=str(tmp_path / "r")), plain, model)
    assert "make them with lowband.integrations.transformers.LowbandTrainingArguments" in \
        str(e.value) and _one_sentence(str(e.value))
    monkeypatch.setenv("RANK", "1")
    ours = LowbandTrainingArguments(output_dir=tmp_path / "hf", report_to="none", seed=7)
    assert (ours.world_size, ours.process_index, ours.data_seed, ours.should_save) == (1, 1, 8,
                                                                                     False)
    with pytest.raises(ConfigError) as e:
        _begin(LowbandCallback("streaming", shards=2, run_dir=str(tmp_path / "r")), ours, model)
    assert "runs one rank a replica group, not shards=2" in str(e.value)
    assert _one_sentence(str(e.value))
    with pytest.raises(ConfigError) as e:  # a heal's step the Trainer's own count cannot follow
        _begin(LowbandCallback("streaming", elastic=True, run_dir=str(tmp_path / "r")), ours, model)
    assert str(e.value).startswith("LowbandCallback does not run elastic") and _one_sentence(str(e.value))
    assert not (tmp_path / "r").exists()  # nothing written, the model untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_accelerate_the_import_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "lowband.integrations.transformers")
    with pytest.raises(ConfigError) as e:
        importlib.import_module("lowband.integrations.transformers")
    assert "needs the hf extra (accelerate is not installed): pip install 'lowband[hf]'." in \
        str(e.value) and _one_sentence(str(e.value))
