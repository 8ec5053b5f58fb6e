"""Continuous online RL (AReaL v2's online mode): the serving proxy is the rollout source.

    run root RUN (prepare, then the SFT task: config.yaml, prompts/, init_model/)
    trainer      LiveSessions (online/live_sessions.py) + PublishingSink: a step per B·G ended
                 sessions, each new version published as weights/v{N}
    reward pool  the run's reward workers: sessions ended without a reward are graded by the
                 task's verifier (trajectories/ungraded/proxy-0/ -> graded/)
    proxy        python -m areal_core.proxy --follow RUN/weights --store RUN --api-key ...:
                 serves each published version once verified, writes each ended session to RUN

With `online.promote_every: k` the version of every k-th step is also scored on the held-out split and becomes the
registry's `champion` only when it wins (online/promotion.py): a proxy following the alias
(production) moves with the gate, one following RUN/weights (research) with every version.

`run_continuous` is the one task of `workflows/online.py: online_continuous` after prepare and
SFT: it holds the run's lease, starts the reward pool as processes and runs the trainer here until
`train.steps` (then final_model/ and DONE); the proxy runs apart, as long as the service does, and
keeps serving the last version. Nothing rolls out: the sessions' tokens carry the versions the
proxy served, and the trainer's hard bound drops a session whose oldest served token is more than
η versions old (counted in `dropped_samples`).
"""

from __future__ import annotations

import logging

from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.store import Store

log = logging.getLogger("areal.online")


def run_continuous(run_uri: str, sft_checkpoint: str) -> dict:
    """Put the SFT checkpoint in the run root, then the reward pool (processes) and the trainer
    (here) until DONE, holding the run's lease. Returns {final_model, step, dropped_samples, left_out}."""
    from areal_core.context import load_run_config, set_threads
    from areal_core.online.live_sessions import LiveSessions
    from areal_core.run.launcher import start_role, stop_all
    from areal_core.run.ownership import RUN_ID_ENV, hold, renew
    from areal_core.run.pipeline import open_run
    from areal_core.train.run_trainer import build_run_trainer

    store = Store(run_uri)
    with hold(store, load_run_config(store).lease, renew=True, checkpoints=True) as lease:
        cfg, tracker = open_run(store, sft_checkpoint)
        set_threads(cfg.threads_per_role)
        env = {RUN_ID_ENV: lease.run_id}
        pool = [start_role("reward", store.uri, i, env) for i in range(cfg.reward.num_workers)]
        try:
            with EventLog(store, "trainer", "0") as events:
                trainer = build_run_trainer(
                    store.uri, cfg, tracker=tracker, guard=lease.check, events=events, source_class=LiveSessions,
                    **promotion_gate(store, cfg),
                )  # fmt: skip
                trainer.fit()
        finally:
            stop_all(pool)
        renew(store, lease.run_id, "done", lease.claim)
    counters, source = trainer.state.counters, trainer.source
    out = {
        "final_model": store.url(LAYOUT.final_model),
        "step": trainer.state.step,
        "dropped_samples": counters.dropped_samples,
        "left_out": getattr(source, "left_out", 0),
    }
    log.info("continuous online RL finished: %s", out)
    return out


def promotion_gate(store: Store, cfg) -> dict:
    """build_run_trainer's `evaluate` and `make_sink` for `online.promote_every` > 0 (a PromotingSink
    on the run's registry), else a PublishingSink: every version is published, none offered."""
    if not cfg.online.promote_every:  # its readers are the proxies writing sessions (weights/faults.py)
        from areal_core.train.sinks import PublishingSink

        return {"make_sink": lambda publisher: PublishingSink(publisher, readers=())}
    from areal_core.evaluate import heldout_score
    from areal_core.online.promotion import PromotingSink, PromotionGate
    from areal_core.prompts import load_prompts
    from areal_core.run.tracking import tracking_uri

    records = load_prompts(store, "eval")[: cfg.eval.num_samples]
    if not records:
        raise ValueError("online.promote_every needs held-out tasks to score versions on: the eval split is empty")
    gate = PromotionGate(store, cfg.online.model_name, tracking_uri(cfg.tracking.uri), cfg.online.min_gain)
    return {
        "evaluate": lambda model, tokenizer: heldout_score(model, tokenizer, cfg, records),
        "make_sink": lambda publisher: PromotingSink(publisher, gate, cfg.online.promote_every),
    }


def continuous_task(run_uri: str, sft_checkpoint: str) -> str:
    """The `continuous_rl` task: `run_continuous`; returns the final model's URI."""
    from areal_core.logs import setup_logging

    setup_logging()
    return run_continuous(run_uri, sft_checkpoint)["final_model"]
