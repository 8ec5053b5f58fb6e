"""The steps a workflow composes: prepare -> SFT -> asynchronous RL -> evaluate.

Each is a plain function of strings (URIs, config text) so Flyte tasks stay thin and
cache on their inputs.
"""

from __future__ import annotations

import json
import logging
import shlex
from typing import Any

from areal_core.config import ConfigError, RunConfig, from_yaml_text, load_config, to_flat_dict, to_yaml
from areal_core.config.base import MAX_YAML_BYTES, excerpt
from areal_core.layout import LAYOUT
from areal_core.retry import configure
from areal_core.run.live import Publish
from areal_core.run.tracking import Tracker
from areal_core.store import RootLost, Store, UnreadableObject, normalize_uri

log = logging.getLogger("areal.pipeline")


def parse_overrides(overrides: str | list[str]) -> list[str]:
    """'a.b=1 c="x y"' or ['a.b=1', 'c=2'] -> ['a.b=1', ...]: split on whitespace with shell
    quoting, never on commas (values and store paths may hold them). ConfigError when unbalanced."""
    if isinstance(overrides, list):
        return overrides
    try:
        return shlex.split(overrides)
    except ValueError as exc:
        raise ConfigError(f"overrides {excerpt(overrides)}: {exc}") from None


def sft_key(cfg: RunConfig) -> str:
    """What the SFT result depends on: seed, task, model and SFT settings."""
    # task.gym holds models (reasoning-gym dataset specs): the task as JSON data, the same text for scalar fields
    part = {"seed": cfg.seed, "task": cfg.task.model_dump(mode="json"), "model": vars(cfg.model), "sft": vars(cfg.sft)}
    if cfg.agent.sft_examples or cfg.agent.corpus:  # an agent's warm start and tokenizer text
        part["agent"] = cfg.agent.model_dump(mode="json")  # mcp_servers are models, not JSON
    return json.dumps(part, sort_keys=True)


BUCKET_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")  # object stores whose root starts with a bucket


def check_root(store: Store) -> None:
    """ConfigError when the run root's bucket does not exist, the root (or a folder above it) is an
    existing file, or when it holds
    entries a new run would clear (LAYOUT.run_state: weights/, trainer/, DONE, ...) but no run
    (neither config.yaml nor LEASE.json): they are someone else's. What a run keeps (labels/,
    init_model/, prompts/, images/) and anything else is never cleared, so it may be there."""
    if store.local:
        path = store.local_path()
        for folder in (path, *path.parents):
            if folder.exists():
                if not folder.is_dir():
                    raise ConfigError(f"config key 'store': {folder} is a file, not a folder for the run root")
                break
    else:
        bucket = store.root.split("/", 1)[0]
        if store.uri.split("://", 1)[0] in BUCKET_STORES and not store.fs.exists(bucket):
            raise ConfigError(f"config key 'store': bucket '{bucket}' does not exist (create it, or fix the URI)")
        if store.fs.isfile(store.root):
            raise ConfigError(f"config key 'store': {store.uri} is an object, not a folder for the run root")
    names = store.listdir("")  # retried like every store read
    cleared = [n for n in names if n in LAYOUT.run_state]  # what prepare would delete (labels/, init_model/ stay)
    if cleared and not {LAYOUT.config, LAYOUT.lease} & set(names):
        shown = ", ".join(cleared[:3]) + (", ..." if len(cleared) > 3 else "")
        raise ConfigError(
            f"config key 'store': {store.uri} holds {shown} but no run (no {LAYOUT.config} or {LAYOUT.lease}); "
            "a new run would delete them, so give it a new or empty folder"
        )


def check_written_config(cfg: RunConfig) -> None:
    """ConfigError when the config.yaml this run would write is one its roles could not read back
    (it is block-style YAML holding every default, so it can pass the input's limits and fail them
    as written), or when settings that only the trainer would check conflict."""
    if cfg.train.lora_rank > 0 and cfg.train.nproc_per_node > 1:
        raise ConfigError(
            "config key 'train.lora_rank' must be 0 with train.nproc_per_node > 1 (LoRA trains on one rank)"
        )
    try:
        from_yaml_text(to_yaml(cfg))
    except ConfigError as exc:
        raise ConfigError(f"the config as the run would store it in {LAYOUT.config}: {exc}") from None


def _comparable(cfg: RunConfig) -> dict[str, Any]:
    """The config without the lease section (how a run holds its root is not what it trains), its
    root as one URI (`runs/x/`, `./runs/x` and `file:///…/runs/x` are one root), flat."""
    flat = {k: v for k, v in to_flat_dict(cfg).items() if not k.startswith("lease.")}
    flat["store"] = normalize_uri(cfg.store)
    return flat


def _differences(stored: dict[str, Any], given: dict[str, Any]) -> str:
    """The keys whose values differ, named (at most 5): what a refused resume must change."""
    keys = sorted(k for k in stored.keys() | given.keys() if stored.get(k) != given.get(k))
    return ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")


def prepare(
    config_path: str, overrides: str | list[str] = "", resume: bool = False, typed: RunConfig | None = None
) -> tuple[str, str]:
    """Validate the config (before any work), claim the run root, write config.yaml and prompts/;
    returns (run URI, SFT key). The config is `load_config(config_path, overrides, typed)`:
    YAML files < the typed config's changes from the defaults < dotted overrides.

    A new run replaces a finished run's state; a live run's root is refused, a stale one taken
    over only with lease.takeover=true (run/ownership.py). `resume` continues the run in the root
    (same run id, same config); there must be one.
    """
    cfg = load_config(config_path or None, parse_overrides(overrides), typed)
    from areal_core.train.algorithm import check_for_model
    from areal_core.train.loss import check_algorithm, complete_settings  # torch: not at import (tasks import this)

    # an unknown loss, or one that cannot split over ranks or micro-batches, or bad loss settings, before any work
    check_algorithm(
        cfg.algo, distributed=cfg.train.nproc_per_node > 1, micro_batches=cfg.train.max_tokens_per_micro_batch > 0
    )
    cfg = cfg.model_copy(update={"algo": complete_settings(cfg.algo)})  # config.yaml records the loss's settings
    check_for_model(cfg.algo, cfg.model.kind)
    check_written_config(cfg)
    configure(cfg.store_retry_s)  # how long this process retries the store, as the roles will
    store = Store(cfg.store)
    check_root(store)
    if resume:
        if not store.exists(LAYOUT.config):
            raise ConfigError(f"cannot resume {store.uri}: no run was started there (no {LAYOUT.config})")
        try:
            stored = store.read_bytes(LAYOUT.config, MAX_YAML_BYTES)
        except UnreadableObject as exc:
            raise ConfigError(f"the run's {LAYOUT.config}: {exc}") from None
        stored_cfg = from_yaml_text(stored, f"the run's {LAYOUT.config}")
        stored_cfg = stored_cfg.model_copy(update={"algo": complete_settings(stored_cfg.algo)})  # as written
        differs = _differences(_comparable(stored_cfg), _comparable(cfg))
        if differs:
            raise ConfigError(f"cannot resume {store.uri}: its config.yaml differs from this config in {differs}")
    from areal_core.run.prepare import prepare_run

    return prepare_run(cfg, resume), sft_key(cfg)


def sft(run_uri: str) -> str:
    """The SFT warm start, renewing the run's lease meanwhile."""
    from areal_core.context import load_run_config
    from areal_core.run.ownership import hold
    from areal_core.train.sft import run_sft

    store = Store(run_uri)
    with hold(store, load_run_config(store).lease, renew=True):
        return run_sft(run_uri)


def ensure_init_model(store: Store, sft_checkpoint: str) -> None:
    """Put the SFT checkpoint in the run root: nothing to do when it is there (SFT ran here),
    a copy when it came from another run (a cache hit), and SFT again when the cached
    checkpoint's folder is gone (a hit after `make clean` or a deleted run root)."""
    here = store.url(LAYOUT.init_model)
    if sft_checkpoint.rstrip("/") == here and store.exists(LAYOUT.committed(LAYOUT.init_model)):
        return
    src_root, _, name = sft_checkpoint.rstrip("/").rpartition("/")
    src = Store(src_root)
    if sft_checkpoint.rstrip("/") != here and src.exists(LAYOUT.committed(name)):
        store.copy_dir(name, LAYOUT.init_model, source=src)
        return
    from areal_core.train.sft import run_sft

    log.warning("the cached SFT checkpoint %s is gone: running SFT again in %s", sft_checkpoint, store.uri)
    run_sft(store.uri)


def mark_failed(run_uri: str) -> bool:
    """The failure handler's step: set the run's MLflow run (if one was opened) to FAILED;
    returns whether there was one."""
    store = Store(run_uri)
    tracker = Tracker.attach(store)
    tracker.finish("FAILED")
    return tracker.enabled


def open_run(store: Store, sft_checkpoint: str) -> tuple[RunConfig, Tracker]:
    """Put the initial model in the run root and open the run's MLflow run (once: a retry or a
    resumed run reuses the one recorded in tracking.json); returns (config, Tracker)."""
    from areal_core.context import load_run_config

    ensure_init_model(store, sft_checkpoint)
    cfg = load_run_config(store)
    return cfg, Tracker.create(store, cfg)


def start_run(run_uri: str, sft_checkpoint: str, tags: dict[str, str]) -> str:
    """The cluster's start: `open_run` with `tags` on the MLflow run, before the roles start
    (which then hold the run's lease themselves)."""
    from areal_core.run.ownership import owner

    store = Store(run_uri)
    owner(store)  # RootLost when the root is no longer this run's
    _, tracker = open_run(store, sft_checkpoint)
    for key, value in tags.items():
        tracker.set_tag(key, value)
    return store.uri


def run_async_rl(run_uri: str, sft_checkpoint: str, publish: Publish | None = None) -> str:
    """Start every role on this machine and wait for DONE, holding (and renewing) the run's lease;
    returns the final model's URI. `publish(html)` (the task's Deck) gets the run's report every
    `launcher.report_every_s` seconds meanwhile, and the final one at the end. Raises RootLost
    when the root was taken over or lost its history under the run."""
    from areal_core.context import load_run_config
    from areal_core.run.launcher import launch
    from areal_core.run.live import LiveReport
    from areal_core.run.ownership import RUN_ID_ENV, hold

    store = Store(run_uri)
    with hold(store, load_run_config(store).lease, renew=True) as lease:
        cfg, tracker = open_run(store, sft_checkpoint)
        live = LiveReport(store.uri, publish or (lambda html: None), cfg.launcher.report_every_s if publish else 0)
        try:
            with live:
                result = launch(
                    store.uri,
                    cfg.rollout.num_workers,
                    cfg.reward.num_workers,
                    cfg.launcher.timeout_s,
                    cfg.launcher.progress,
                    env={RUN_ID_ENV: lease.run_id},
                )
            lease.check()  # DONE counts only in a root that is still this run's
        except Exception as exc:
            tracker.finish("FAILED")
            if publish:  # the Deck shows how far the failed run got
                live.tick()
            lost = lease.lost_reason()
            if lost:  # the roles stopped because the root is no longer this run's: say so
                raise RootLost(lost) from exc
            raise
    tracker.log_metrics({"wall_s": result["wall_s"]}, result["step"])
    log.info("async RL finished in %.1fs", result["wall_s"])
    report = log_report(store, tracker)
    if publish:
        publish(report)
    return store.url(LAYOUT.final_model)


def log_report(store: Store, tracker: Tracker, heldout: tuple[float, float] | None = None) -> str:
    """Build the run's report and log it to MLflow as report/report.html (replacing an earlier
    one); without `heldout` (the end of RL) also log its per-step series as `report/...` metrics
    and print the doctor's verdict (health flags as warnings). Returns the report's <div> (for a
    Deck; "" when it could not be built: a warning, never a failed run)."""
    import tempfile
    from pathlib import Path

    from areal_core.report.data import load_run
    from areal_core.report.doctor import diagnose
    from areal_core.report.html import page, render
    from areal_core.report.series import step_metrics

    try:
        data = load_run(store)
        report = render(data, heldout)
    except Exception as exc:  # noqa: BLE001 - a report is never worth a failed run
        log.warning("the run report of %s was not built: %s: %s", store.uri, type(exc).__name__, exc)
        return ""
    if heldout is None:
        findings = diagnose(data.records, data.rows)
        print(f"doctor: {findings[0].line()}")
        for finding in findings[1:]:
            log.warning("doctor: %s", finding.line())
        series = step_metrics(data.records, data.rows)
        tracker.log_series({step: {f"report/{k}": v for k, v in m.items()} for step, m in series.items()})
    if tracker.enabled:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "report.html").write_text(page(report), encoding="utf-8")
            tracker.log_artifacts(tmp, "report")
    return report


def evaluate_run(run_uri: str) -> dict[str, Any]:
    """Held-out greedy accuracy (agent runs: agent success) of the SFT checkpoint and of the final
    model, logged to MLflow; the first HELDOUT_ANSWERS questions' answers before and after are
    recorded for the report (`record_answers`)."""
    import torch

    from areal_core.context import load_run_config
    from areal_core.evaluate import heldout_eval
    from areal_core.forks import image_roots
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.vlm.images import ImageCache

    store = Store(run_uri)
    cfg = load_run_config(store)
    torch.set_num_threads(max(2, cfg.threads_per_role))
    records = load_prompts(store, "eval")[: cfg.eval.num_samples]
    images = ImageCache(image_roots(store)) if cfg.model.kind == "vlm" else None  # held-out questions' images
    out: dict[str, Any] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    for label, rel in (("before", LAYOUT.init_model), ("after", LAYOUT.final_model)):
        model, tokenizer = load_pretrained(store.url(rel), cfg.device)
        out[label], answers[label] = heldout_eval(model, tokenizer, cfg, records, images, keep=HELDOUT_ANSWERS)
    out["gain"] = out["after"] - out["before"]
    record_answers(store, answers, out)
    out["curves"] = metrics_rows(store)
    metric = "heldout_agent_success" if cfg.rollout.agent else "heldout_accuracy"
    tracker = Tracker.attach(store)
    tracker.log_metrics({f"{metric}_before": out["before"], f"{metric}_after": out["after"]}, 0)
    out["report"] = log_report(store, tracker, (out["before"], out["after"]))
    # an MLflow transformers model, like every registered version: runs:/<id>/final_model serves as it is
    tracker.log_model(LAYOUT.final_model, lambda folder: store.get_dir(LAYOUT.final_model, folder))
    tracker.finish()
    what = f"agent success ({cfg.rollout.agent})" if cfg.rollout.agent else "greedy accuracy"
    print(f"held-out {what}: before RL {out['before']:.3f}, after RL {out['after']:.3f} ({out['gain']:+.3f})")
    return out


HELDOUT_ANSWERS = 6  # held-out questions whose answers before and after RL the report shows


def record_answers(store: Store, answers: dict[str, list[dict[str, Any]]], scores: dict[str, Any]) -> None:
    """Write `Layout.heldout_answers`: each of the first held-out questions with the answers before
    and after RL (the report shows them, a VLM's with its picture). Never fails the evaluation: a
    report is not worth a failed run."""
    before, after = answers.get("before", []), answers.get("after", [])
    keys = ("answer", "reward", "correct")
    rows = [
        {
            **{k: v for k, v in b.items() if k not in keys},
            "before": {k: b[k] for k in keys},
            "after": {k: a[k] for k in keys},
        }
        for b, a in zip(before, after)
        if b["prompt_id"] == a["prompt_id"]
    ]
    body = {"version": 1, "scores": {k: scores[k] for k in ("before", "after")}, "answers": rows}
    try:
        store.write_json(LAYOUT.heldout_answers, body)
    except Exception as exc:  # noqa: BLE001 - the report says "not recorded" instead
        log.warning("the held-out answers of %s were not recorded: %s: %s", store.uri, type(exc).__name__, exc)


def metrics_rows(store: Store) -> list[dict[str, float]]:
    if not store.exists(LAYOUT.metrics):
        return []
    return [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]
