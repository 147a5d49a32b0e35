"""summary.json: a run's totals over its ranks, written here and nowhere else (a plain run's by
its rank 0, write_plain; an elastic run's by its launcher from the groups' records,
write_elastic), and the one line that prints them."""

from __future__ import annotations

import math
from collections import Counter

from lowband.comm.membership.lives import lighthouse_life
from lowband.telemetry import RunDir, read_events, write_json_atomic
from lowband.units import fmt_si, parse_bandwidth


def save(run: RunDir, summary: dict) -> None:
    """summary.json, whole or not at all (a reader never sees half)."""
    write_json_atomic(run.summary, summary)


def write_plain(cfg, run: RunDir, ranks: list[dict], ddp_one_step: int,
                tokens_per_step: int | None) -> dict:
    """A run's summary.json from every rank's totals (session.py), with the baseline's bytes
    for the same model and steps (add_ddp_bytes)."""
    summary = summarize(cfg, ranks)
    add_ddp_bytes(summary, ddp_one_step, cfg.replicas, tokens_per_step)
    save(run, summary)
    return summary


def write_group_record(run: RunDir, replica: int, ranks: list[dict], ddp_one_step: int,
                       outer_sha256: str | None, model_sha256: str | None) -> None:
    """--elastic: a finished replica group's record (its ranks' totals, what ddp would send a
    step, digests of its final state), which write_elastic sums with the others'."""
    run.groups.mkdir(exist_ok=True)
    write_json_atomic(run.group_record(replica),
                      {"ranks": ranks, "ddp_one_step": ddp_one_step,
                       "outer_sha256": outer_sha256, "model_sha256": model_sha256})


def summarize(cfg, ranks: list[dict]) -> dict:
    """summary.json: totals over ranks (see docs/run-directory.md for every field)."""
    wall = max(r["wall_s"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    compute = sum(r["compute_s"] for r in ranks) / len(ranks)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    per_replica = [r["steps"] for r in ranks if r["shard"] == 0]  # ranks in rank order
    run = sum(per_replica) / len(per_replica)  # aedit's replicas run different step counts
    return {
        "algorithm": cfg.algo, "replicas": cfg.replicas, "shards": cfg.shards, "steps": cfg.steps,
        "steps_run": int(run) if run == int(run) else round(run, 2), "steps_run_per_replica": per_replica,
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "compute_s": compute, "compute_utilization": mean([r["compute_s"] / r["wall_s"] for r in ranks]),
        "outer_wire_bytes": sum(r["outer_wire"] for r in ranks),
        "inner_wire_bytes": sum(r["inner_wire"] for r in ranks),
        "peak_outer_payload_bytes": max(r["peak_outer"] for r in ranks),
        "setup_wire_bytes": sum(r.get("setup_wire", 0) for r in ranks),
        "final_loss": mean([r["loss"] for r in ranks]),
        "final_val_loss": mean([r["val_loss"] for r in ranks if r["shard"] == 0]),
        "run_dir": cfg.run_dir,
        **_acco(cfg, tokens, len(ranks), run),
        # every replica's copy of the outer state the same (None: the algorithm keeps none)
        "outer_states_agree": None if ranks[0].get("outer_sha256") is None else
        len({r["outer_sha256"] for r in ranks}) == 1,
        **({"target": target(ranks[0].get("evals", []), cfg.target_loss)}
           if cfg.target_loss else {}),
        **guarded(ranks),
    }


def guarded(ranks: list[dict]) -> dict:
    """summary.json's `left_out` (every update the guard left out, or merge it bounded: each
    once, in step order; algorithms/guard.py), `left_out_updates` (their count), `guard_s` (the
    guard's own seconds a rank, on average: its norms sent and judged), and
    `diverged` (a sentence) where the validation loss ended non-finite, above 1.5x the loss of a
    uniform guess over the vocabulary (where known: an untrained model starts near it), or above
    twice its best."""
    seen = {}
    for r in ranks:
        for rec in r.get("guard") or []:
            seen.setdefault((rec["step"], rec["fragment"], rec.get("left_out"), rec["why"]), rec)
    out = {}
    if any("guard" in r for r in ranks):
        out["left_out"] = [seen[k] for k in sorted(seen, key=lambda k: (k[0], str(k[1]), str(k[2])))]
        out["left_out_updates"] = sum(1 for k in seen if k[2] is not None)
        out["rollbacks"] = sum(1 for k in seen if k[3] == "rollback")
        out["guard_s"] = sum(r.get("guard_s", 0.0) for r in ranks) / len(ranks)
    evals = [e[1] for e in ranks[0].get("evals", [])]
    final = ranks[0].get("val_loss")
    if final is None:
        return out
    best = min((v for v in evals if math.isfinite(v)), default=math.inf)
    uniform = math.log(ranks[0]["vocab"]) if ranks[0].get("vocab") else math.inf
    head = f"the run diverged: its validation loss ended at {final:.4g}"
    if not math.isfinite(final):
        out["diverged"] = head
    elif final > 1.5 * uniform:
        out["diverged"] = f"{head}, above 1.5x a uniform guess's ({uniform:.4g})"
    elif final > 2 * best:
        out["diverged"] = f"{head}, above twice its best ({best:.4g})"
    return out


def guard_text(s: dict) -> str:
    """The guard's words for the terminal line and the report: "1 update left out (replica 1's
    update at step 40 was left out: its norm was 35x its usual)"; "" with none."""
    recs = s.get("left_out") or []
    if not recs:
        return ""
    n, back = s.get("left_out_updates", 0), s.get("rollbacks", 0)
    first = recs[0]["text"] + (f"; {len(recs) - 1} more in summary.json" if len(recs) > 1 else "")
    counts = ([_count(n, "update", "updates") + " left out"] if n or not back else []) + \
        ([_count(back, "rollback", "rollbacks")] if back else [])
    return f"{', '.join(counts)} ({first})"


def target(evals: list, loss: float) -> dict:
    """summary.json's `target` (--target-loss): what the first evaluation whose validation loss
    (mean over replicas) is at or below `loss` took, from the run-wide records of the
    evaluations every rank took ([step, val_loss, elapsed_s, tokens, outer_bytes], in order:
    session.Progress.evals); when none is, the best loss evaluated."""
    for step, val, elapsed, tokens, outer in evals:
        if val <= loss:
            return {"loss": loss, "reached": True, "step": step, "val_loss": val,
                    "elapsed_s": elapsed, "tokens": tokens, "outer_bytes": outer}
    finite = [e for e in evals if math.isfinite(e[1])]
    best = min(finite, key=lambda e: e[1]) if finite else [None, None]
    return {"loss": loss, "reached": False, "best_val_loss": best[1], "best_step": best[0],
            "evaluations": len(evals)}


def _acco(cfg, tokens: int, world: int, steps_run: float) -> dict:
    """acco's steps take as many micro-batches as its budget and rounds give them:
    micro_batches_per_step is their mean per rank and step (ddp's is --grad-accum)."""
    if cfg.algo != "acco" or not steps_run:
        return {}
    return {"micro_batches_per_step": tokens / (cfg.batch_size * cfg.seq_len) / world / steps_run}


def add_ddp_bytes(summary: dict, one_step: int, replicas: int,
                  tokens_per_step: int | None = None) -> None:
    """ddp_outer_wire_bytes: what ddp would have sent for the inner steps the run took
    (R x steps_run), from its bytes for one step; with tokens_per_step (ddp's tokens in one
    step over all ranks), for the tokens the run trained on (the same for every algorithm whose
    step is ddp's; acco's steps take more micro-batches). ddp_steps: ddp's steps they are for."""
    if tokens_per_step:
        summary["ddp_outer_wire_bytes"] = one_step * summary["tokens"] // tokens_per_step
        summary["ddp_steps"] = round(summary["tokens"] / tokens_per_step, 2)
    else:
        summary["ddp_outer_wire_bytes"] = one_step * sum(summary["steps_run_per_replica"]) // replicas
        summary["ddp_steps"] = round(sum(summary["steps_run_per_replica"]) / replicas, 2)



def write_elastic(cfg, run: RunDir) -> dict:
    """--elastic: summary.json from the groups' records (write_group_record), with what faults
    cost them (`elastic`); the launcher writes it once the groups have finished."""
    records = [run.read_json(p) for p in run.group_records().values()]
    records = [r for r in records if r]
    ranks = [rank for r in records for rank in r["ranks"]]
    summary = summarize(cfg, ranks)
    summary["run_dir"] = str(run.root)  # (the launcher may have named it: cfg's is empty then)
    summary["elastic"] = elastic_record(cfg, run, sorted({r["replica"] for r in ranks}))
    group_step = cfg.grad_accum * cfg.batch_size * cfg.seq_len * cfg.shards
    count_every_life(summary, cfg, run, ranks, group_step)
    add_ddp_bytes(summary, records[0]["ddp_one_step"], cfg.replicas, cfg.replicas * group_step)
    save(run, summary)
    return summary


def count_every_life(summary: dict, cfg, run: RunDir, ranks: list[dict], group_step: int) -> None:
    """`tokens`, `tokens_per_s`, `steps_run` and `steps_run_per_replica` (one entry a group)
    count what every life of every group trained: the step events of each group's first rank,
    a lost life's included (a group's ranks' totals cover only its last life and the
    checkpoint it went on from; a healed group's skipped steps were never trained). Tokens
    trained but thrown away (by a life that died, after the step its group went on from; all of
    a group lost for good) are `elastic.tokens_lost`. group_step: a group's tokens in one step."""
    steps = [run.count_events(g * cfg.shards, "step") for g in range(cfg.replicas)]
    kept = sum(r["tokens"] for r in ranks)
    summary["tokens"] = sum(steps) * group_step
    summary["tokens_per_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] > 0 else 0.0
    summary["steps_run_per_replica"] = steps
    mean = sum(steps) / len(steps)
    summary["steps_run"] = int(mean) if mean == int(mean) else round(mean, 2)
    summary["elastic"]["tokens_lost"] = summary["tokens"] - kept


def elastic_record(cfg, run: RunDir, finished: list[int]) -> dict:
    """summary.json's `elastic`, from the events of each group's first rank: the groups that
    finished; the times each was restarted (its `run` events marked restart); its heals (its
    membership events, healed: a live peer's state received); and `lost_work`, one entry a
    life lost: the group, the step its life died after, the step its next life began at (its
    newest checkpoint's, 0 without one; None: lost for good) and the steps of the lost life
    it trained again (`redone`, [first, last]; None when a peer's state came first)."""
    events = [e for e in read_events(run, ("run", "membership", "step", "quorum"))
              if e["rank"] % cfg.shards == 0 and "replica" in e]
    restarts = [e for e in events if e["kind"] == "run" and e.get("restart")]
    heals = Counter(e["replica"] for e in events if e["kind"] == "membership" and e.get("healed"))
    steps = [e for e in events if e["kind"] == "step"]
    lost = []
    for r in restarts:
        g, t = r["replica"], r["t"]
        before = [e["step"] for e in steps if e["replica"] == g and e["t"] < t]
        died = r.get("superseded_to", before[-1] if before else 0)
        later = [e["t"] for e in restarts if e["replica"] == g and e["t"] > t]
        again = sorted({e["step"] for e in steps if e["replica"] == g and t < e["t"] < min(
            later, default=float("inf")) and r["step"] < e["step"] <= died})
        lost.append({"group": g, "died_after": died, "resumed_from": r["step"],
                     "redone": [again[0], again[-1]] if again else None})
    left_out = run.read_json(run.left_out) or {}
    for g in sorted(set(range(cfg.replicas)) - set(finished)):
        mine = [e["step"] for e in steps if e["replica"] == g]
        why = {"left_out": left_out[str(g)]} if str(g) in left_out else {}
        lost.append({"group": g, "died_after": mine[-1] if mine else 0, "resumed_from": None,
                     "redone": None, **why})
    lost.sort(key=lambda life: life["group"])  # (each group's lives stay in time order)
    return {"groups_finished": finished, "lighthouse_restarts": lighthouse_life(run.lighthouse_life),
            "lighthouse_down_s": run.read_json(run.lighthouse_down) or [],
            "restarts": {str(g): n for g, n in sorted(Counter(e["replica"] for e in restarts).items())},
            "heals": {str(g): n for g, n in sorted(heals.items())}, "lost_work": lost,
            "participation": participation(sync_participation(events))}

def one_line(s: dict) -> str:
    return (f"{s.get('algorithm')} R={s.get('replicas')} S={s.get('shards')}: "
            f"loss {s.get('final_loss', float('nan')):.4f}, "
            f"val loss {s.get('final_val_loss', float('nan')):.4f}, "
            f"{s.get('tokens_per_s', 0):,.0f} tokens/s, "
            + (f"{s['micro_batches_per_step']:.1f} micro-batches/step over {s.get('steps_run')} "
               "steps, " if "micro_batches_per_step" in s else "") +
            f"outer link {fmt_si(s.get('outer_wire_bytes', 0), 'B')}, "
            f"compute utilization {100 * s.get('compute_utilization', 0):.0f}%"
            + target_text(s.get("target")) + (f"; {faults}" if (faults := fault_text(s)) else "")
            + (f"; {guard}" if (guard := guard_text(s)) else ""))


def fault_text(s: dict) -> str:
    """What faults cost an --elastic run (summary.json's `elastic`), "" without any: "2 group
    deaths, 2 restarts, 1 heal of group 1, 4 steps redone, 1.2 k tokens trained and lost (group
    0 died after step 24, restarted from step 20: steps 21–24 redone; group 1 died after step
    25, restarted from step 20: steps 21–25 lost)". A life died after the last step it
    recorded; its lost steps are those after its checkpoint that its group did not train again
    (a live peer's state, further on, replaced the checkpoint's)."""
    el = s.get("elastic")
    if not isinstance(el, dict):
        return ""
    lives, heals = el.get("lost_work") or [], el.get("heals") or {}
    lighthouse = el.get("lighthouse_restarts") or 0
    if not lives and not heals and not lighthouse:  # (a group that started late heals too)
        return ""
    n_heals, redone, parts = sum(heals.values()), 0, []
    for life in lives:
        g, died, start, again = (life.get(k) for k in ("group", "died_after", "resumed_from", "redone"))
        if life.get("left_out"):  # stopped at the end (launch/supervise.py)
            parts.append(f"group {g} stopped after step {died}: {life['left_out']}")
            continue
        text = f"group {g} died after step {died}"
        if start is None:
            parts.append(text + ", not restarted")
            continue
        text += f", restarted from step {start}" if start else ", restarted afresh"
        notes = []
        if again:
            redone += again[1] - again[0] + 1
            notes.append(f"{_steps(*again)} redone")
        if start and died >= (again[1] if again else start) + 1:  # a peer's state came first
            notes.append(f"{_steps((again[1] if again else start) + 1, died)} lost")
        parts.append(text + (f": {', '.join(notes)}" if notes else ""))
    restarts = sum(1 for life in lives if life.get("resumed_from") is not None)
    healed = ", ".join(f"group {g}" for g in heals)
    deaths = sum(1 for life in lives if not life.get("left_out"))
    counts = [_count(deaths, "group death", "group deaths"),
              _count(restarts, "restart", "restarts"),
              _count(n_heals, "heal", "heals") + (f" of {healed}" if n_heals else ""),
              _count(redone, "step redone", "steps redone")]
    if el.get("tokens_lost"):
        counts.append(f"{fmt_si(el['tokens_lost'])} tokens trained and lost")
    if lighthouse:
        counts.append(_count(lighthouse, "Lighthouse restart", "Lighthouse restarts"))
    return ", ".join(counts) + (f" ({'; '.join(parts)})" if parts else "")


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def target_text(t) -> str:
    """The one line's note on --target-loss ("" for a run without one, or an older run)."""
    if not isinstance(t, dict) or "loss" not in t:
        return ""
    if t.get("reached"):
        return (f"; target val loss {t['loss']:g} reached at step {t.get('step')} after "
                f"{t.get('elapsed_s', 0):.1f} s, {fmt_si(t.get('tokens', 0))} tokens, "
                f"{fmt_si(t.get('outer_bytes', 0), 'B')} outer")
    best = t.get("best_val_loss")
    return f"; target val loss {t['loss']:g} not reached" + (
        f" (best {best:.4f})" if isinstance(best, (int, float)) else "")


def comparison(s: dict, link_bandwidth=None) -> str:
    """The run's headline, which `lowband train` prints and its report opens with: what ddp
    would have sent over the outer link for the same model and tokens (computed from the
    parameters' sizes, summary field ddp_outer_wire_bytes; ddp_steps of its steps, which are the
    run's own unless its steps are larger, as acco's) beside what the run sent, and on an
    emulated link (link_bandwidth: the run's --link-bandwidth, '100Mbit' or bits per second)
    the link time that takes a step against the run's compute a step; "" for ddp itself."""
    ddp, sent = s.get("ddp_outer_wire_bytes"), s.get("outer_wire_bytes", 0)
    try:
        link_bandwidth_bps = parse_bandwidth(link_bandwidth or 0)
    except ValueError:  # a record the parser cannot read: the bytes alone
        link_bandwidth_bps = 0.0
    if not ddp or s.get("algorithm") == "ddp":
        return ""
    times = ddp / sent if sent else 0
    times = f"{times:,.0f}" if times >= 10 else f"{times:.2g}"
    ratio = f"{times}x what {s.get('algorithm')} sent" if sent else "where this run sent nothing"
    ran = s.get("steps_run", s.get("steps"))
    steps = s.get("ddp_steps", ran)  # ddp's steps for the run's tokens (acco's steps are larger)
    same = steps == ran
    line = (f"ddp would have sent {fmt_si(ddp, 'B')} over the outer link for the same model and "
            + (f"{ran} steps (" if same else f"tokens ({steps:g} of its steps; ")
            + f"computed from the parameter sizes): {ratio}")
    if link_bandwidth_bps > 0 and s.get("replicas") and steps:
        send = 8 * ddp / s["replicas"] / steps / link_bandwidth_bps
        compute = s.get("compute_s", 0) / steps
        line += (f"; on this link that is {send:.2f} s a step of sending alone, against "
                 f"{compute:.2f} s of compute a step" if same else
                 f"; on this link that is {send:.2f} s of sending alone a ddp step, against "
                 f"{compute:.2f} s of this run's compute for a ddp step's tokens")
    return line


def sync_participation(events) -> list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Each quorum of an --elastic run (a sync's; ddp: a step's; the run's first), from its
    groups' `quorum` events: (step, the groups alive then, the groups that took part, those of
    them healed in it: weight 0), in step order. One quorum is the events of one step and
    quorum id (a healed group writes the step of the state it received: the others'); alive is
    what each group's first rank heard from the Lighthouse (heartbeats within its timeout), the
    members with it."""
    seen: dict = {}
    for e in events:
        if e.get("kind") != "quorum" or not isinstance(e.get("step"), int):
            continue
        alive, members, healed = seen.setdefault((e["step"], e.get("quorum_id")),
                                                 (set(), set(), set()))
        members.update(e.get("members") or ())
        alive.update(e.get("alive") or ())
        if e.get("healed"):
            healed.add(e.get("replica"))
    return [(step, tuple(sorted(alive | members)), tuple(sorted(members)), tuple(sorted(healed)))
            for (step, _), (alive, members, healed) in sorted(seen.items(), key=lambda kv: kv[0][0])]


def participation(rows) -> dict:
    """summary.json's elastic `participation` from sync_participation's rows: the syncs, the
    mean groups that took part and that were alive, their ratio, and the syncs every alive
    group took part in."""
    if not rows:
        return {}
    took, alive = [len(r[2]) for r in rows], [len(r[1]) for r in rows]
    return {"syncs": len(rows), "mean_participants": round(sum(took) / len(rows), 3),
            "mean_alive": round(sum(alive) / len(rows), 3),
            "participation": round(sum(took) / sum(alive), 3) if sum(alive) else None,
            "syncs_all_alive_took_part": sum(1 for r in rows if set(r[1]) <= set(r[2]))}
