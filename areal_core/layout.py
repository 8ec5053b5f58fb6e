"""`Layout`: every path under a run root, named in one place (docs/design.md, "Store layout"),
and `check_name`, the one validator of every name that becomes part of a store path.

    check_name("rollout-0", "worker id")      # 'rollout-0'
    check_name("../prompts", "labels file")   # BadName: labels file '../prompts' holds a path separator ...
    inside("/runs/a", "labels/../../b")       # BadName: ... resolves outside the run root
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import unicodedata

_LAYER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # not hidden, not a path
_SEQ = re.compile(r"[0-9]{1,18}")  # a shard's sequence number as the writers name it
_IMAGE_ID = re.compile(r"[0-9a-f]{64}")  # an image's id: the sha256 of its bytes, lower-case hex
QUARANTINE_NAME_BYTES = 200  # a quarantined shard's file name, with room for the reason file's suffix
MAX_NAME_CHARS = 128  # a name that becomes one folder or file name (file systems allow 255 bytes)
_SEPARATORS = frozenset("/\\")
_CONTROL = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))  # control, format (bidi, zero-width), surrogate, line breaks
_RULE = f"a name is 1-{MAX_NAME_CHARS} characters, not '.'/'..' or hidden, with no '/', '\\', NUL or control character"


class BadName(ValueError):
    """A name (label, layer, worker, session, run root) that cannot become part of a store path;
    the message (one line) says which rule it breaks."""


def check_name(name: object, what: str = "name") -> str:
    """`name` when it can be one folder or file name under a run root, else BadName. Refused:
    empty, longer than MAX_NAME_CHARS, `.` and `..` and any hidden name (the store's temporary
    and lock files start with '.'), a separator in any form ('/', '\\'), NUL and every control or
    format character. Look-alikes of separators (U+2215 '∕', U+FF0F '／') are ordinary characters.
    Used by every Layout path builder that takes a name, and by the entry points that take one
    (labels, re-grade layers, worker ids, proxy session ids, `--into` roots)."""
    if not isinstance(name, str):
        raise BadName(f"{what} must be a string, got {type(name).__name__}")
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "")

    def bad(why: str) -> BadName:
        return BadName(f"{what} {shown} {why}; {_RULE}")

    if not name:
        raise bad("is empty")
    if len(name) > MAX_NAME_CHARS:
        raise bad(f"is {len(name)} characters, over {MAX_NAME_CHARS}")
    if name in (".", ".."):
        raise bad("is a relative folder")
    if name[0] == ".":
        raise bad("starts with '.' (hidden)")
    for ch in name:
        if ch in _SEPARATORS:
            raise bad("holds a path separator")
        if unicodedata.category(ch) in _CONTROL:
            raise bad(f"holds the control character U+{ord(ch):04X}")
    return name


def check_root(uri: str, what: str = "run root") -> str:
    """`uri` when it can be a new run root (`--into` of fork and replay): no NUL or control
    character anywhere, and its last segment a valid name (check_name: not '.', '..', hidden or
    overlong). BadName otherwise."""
    body = str(uri).split("://", 1)[-1].rstrip("/")
    for ch in body:
        if unicodedata.category(ch) in _CONTROL:
            raise BadName(f"{what} {str(uri)[:80]!r} holds the control character U+{ord(ch):04X}")
    check_name(body.rsplit("/", 1)[-1], f"{what} {str(uri)[:80]!r}: its folder name")
    return uri


def inside(root: str, rel: str) -> str:
    """`root/rel`, after checking that it stays under `root` once '.' and '..' are resolved
    (lexically: the same rule for a local path and an object key); BadName when it does not."""
    full = f"{root}/{rel}" if rel else root
    if "." in rel:
        base = posixpath.normpath(root)
        norm = posixpath.normpath(full)
        if norm != base and not norm.startswith(base.rstrip("/") + "/"):
            raise BadName(f"path {rel[:80]!r} resolves outside the run root {root[:80]!r}")
    return full


class Layout:
    """Every path under a run root, relative to it (docs/design.md, "Store layout").

    config.yaml                                   the resolved config of the run
    prompts/part-{N:05d}.parquet                  the prepared prompt set
    images/{sha[:2]}/{sha}                        a prompt's image (PNG/JPEG), named by its sha256 (vlm/images.py)
    weights/v{N:06d}/ + MANIFEST.json             one published version; weights/LATEST names the newest
    trajectories/{ungraded,graded}/{worker}/{seq:08d}.arrow
    trajectories/regraded/{layer}/{worker}/{seq:08d}.arrow  a re-graded copy of the graded layer
      + REGRADE.json (request, then summary), changes.parquet, COMMITTED (reward/regrade.py)
    trainer/checkpoints/step-{N:06d}/ + COMMITTED model, optimizer, pending samples, state
    trainer/trained/step-{N:06d}.json             the audit record of one trained step
    trainer/drops/step-{N:06d}.json               the samples dropped since the previous checkpoint (train/drops.py)
    trainer/metrics.jsonl, trainer/discarded_groups.json, trainer/live_settled.json,
      trainer/promotions.json
    status/{role}-{id}.json                       heartbeats
    weights_faults/{id}.json, readers_retired/{id}.json  a reader's failing version; a reader out of the run
    events/{role}-{id}/{seq:08d}.jsonl            timing events, appended in batched parts (events.py)
    LEASE.json                                    the owning run: run id, host/pid, heartbeat (run/ownership.py)
    quarantine/{path with / as __}                shards that failed to parse, + .reason.json
    DONE, tracking.json                           end of the run; the MLflow run it logs to
    heldout_answers.json                          a few held-out answers before/after RL, for the report
    init_model/, final_model/ (+ COMMITTED)       the policy RL starts from and the trained one (HF)
    lineage/parent.json                           a fork's reference to its parent (forks.py)
    lineage/children/{id}.json                    in a forked run: one record per fork made of it
    lineage/replay.json                           a replay's source run, settings and comparison
    lineage/request.json, lineage/result.json     a fork's or replay's request (first) and result (last)
    labels/, exports/preference_pairs.parquet     human labels in; preference pairs out
    sessions/ (a proxy store: trajectories/ + online/cursor.json + online/consumed/{run}.txt.gz),
    online/{run}/: a retraining run
    root (+ online_plan.json, online_result.json, online_samples.txt.gz)
    """

    # -- markers and file names --------------------------------------------------------------
    committed_name = "COMMITTED"  # last file of a checkpoint, init_model/, final_model/
    manifest_name = "MANIFEST.json"  # sha256 of every file of a weights version, checkpoint, init_model/
    latest_name = "LATEST"  # written after a version's manifest: the newest complete version
    markers = (committed_name, manifest_name, latest_name)  # written after everything they mark

    # -- top level -------------------------------------------------------------------------------
    config = "config.yaml"
    prompts_dir = "prompts"
    images_dir = "images"  # content-addressed, kept across runs like prompts/ (not run_state)
    weights_root = "weights"
    latest = f"{weights_root}/{latest_name}"
    trajectories_dir = "trajectories"
    ungraded_dir = f"{trajectories_dir}/ungraded"
    graded_dir = f"{trajectories_dir}/graded"
    regraded_dir = f"{trajectories_dir}/regraded"
    base_layers = ("ungraded", "graded")  # the run's own layers; any other name is a re-graded layer
    trainer_dir = "trainer"
    checkpoints_dir = f"{trainer_dir}/checkpoints"
    trained_dir = f"{trainer_dir}/trained"
    drops_dir = f"{trainer_dir}/drops"  # the drop records, one file per checkpoint (train/drops.py)
    metrics = f"{trainer_dir}/metrics.jsonl"
    discarded_groups = f"{trainer_dir}/discarded_groups.json"  # {"groups": D}: admission given back by the trainer
    promotions = f"{trainer_dir}/promotions.json"  # continuous mode: the gate's offers and the score to beat
    live_settled = f"{trainer_dir}/live_settled.json"  # {"rows": {proxy: n}}: session rows settled, for admission
    status_dir = "status"
    events_dir = "events"
    quarantine_dir = "quarantine"
    done = "DONE"
    lease = "LEASE.json"  # who owns the root; kept across runs (a new run replaces it, run/ownership.py)
    writers_dir = "writers"  # one claim per shard writer id (writer_claim.py)
    weights_faults_dir = "weights_faults"  # a reader's report of a version it cannot load (weights/faults.py)
    readers_retired_dir = "readers_retired"  # a reader taken out of the run (weights/faults.py)
    tracking = "tracking.json"
    heldout_answers = "heldout_answers.json"  # evaluate_run: the first held-out questions, answered before/after RL
    init_model = "init_model"  # the policy RL starts from (after SFT), HF format
    hf_config = "config.json"  # an HF model folder's config (init_model/, final_model/, a user's checkpoint)
    init_config = f"{init_model}/{hf_config}"  # its HF config: the dtype the user's checkpoint is stored in
    final_model = "final_model"  # the trained policy, HF format, written before DONE
    labels_dir = "labels"
    exports_dir = "exports"
    preference_pairs = f"{exports_dir}/preference_pairs.parquet"
    online_dir = "online"
    online_consumed_dir = f"{online_dir}/consumed"  # in a sessions store: what each online run trained on
    online_cursor = f"{online_dir}/cursor.json"  # in a sessions store: the last consumed shard per worker
    online_plan = "online_plan.json"  # in an online retraining run root
    online_result = "online_result.json"
    online_samples = "online_samples.txt.gz"  # in an online retraining run root: identities of its rows
    sessions_dir = "sessions"
    lineage_dir = "lineage"
    fork_parent = f"{lineage_dir}/parent.json"  # a forked root: parent, step, shards by reference, cursors
    fork_children_dir = f"{lineage_dir}/children"
    replay_record = f"{lineage_dir}/replay.json"
    derived_request = f"{lineage_dir}/request.json"  # a fork's or replay's request: its first object (run/derived.py)
    derived_result = f"{lineage_dir}/result.json"  # what it returned: its last object, the root is complete
    # Everything that belongs to one training attempt (cleared for a new run; config, prompts,
    # init_model and labels stay).
    run_state = (
        weights_root,
        trajectories_dir,
        trainer_dir,
        status_dir,
        weights_faults_dir,
        readers_retired_dir,
        events_dir,
        quarantine_dir,
        done,
        tracking,
        heldout_answers,
        final_model,
        lineage_dir,
    )

    # -- prompts -------------------------------------------------------------------------------
    def prompts_part(self, part: int) -> str:
        return f"{self.prompts_dir}/part-{part:05d}.parquet"

    # -- images ----------------------------------------------------------------------------------
    def image(self, image_id: str) -> str:
        """Where image `image_id` (the sha256 hex of its bytes) is stored; BadName for any other id."""
        check_name(image_id, "image id")
        if not _IMAGE_ID.fullmatch(image_id):
            raise BadName(f"image id {image_id[:80]!r} is not a sha256 (64 lower-case hex digits)")
        return f"{self.images_dir}/{image_id[:2]}/{image_id}"

    # -- weights ---------------------------------------------------------------------------------
    version_prefix = "v"  # weights/v000012
    step_prefix = "step-"  # trainer/checkpoints/step-000012, trainer/trained/step-000012.json

    @staticmethod
    def _numbered(name: str, prefix: str) -> int | None:
        """'{prefix}000012' -> 12; None for a name that is not prefix + digits."""
        rest = name[len(prefix) :]
        return int(rest) if name.startswith(prefix) and rest.isdigit() else None

    def weights_dir(self, version: int) -> str:
        return f"{self.weights_root}/{self.version_prefix}{version:06d}"

    def weights_file(self, version: int, name: str) -> str:
        return f"{self.weights_dir(version)}/{name}"

    def manifest(self, version: int) -> str:
        return self.weights_file(version, self.manifest_name)

    def weights_version(self, name: str) -> int | None:
        """'v000012' (an entry of weights/) -> 12; None for anything else (LATEST)."""
        return self._numbered(name, self.version_prefix)

    # -- trajectories ------------------------------------------------------------------------------
    def shard_dir(self, stage: str, worker: str) -> str:
        """stage: 'ungraded' or 'graded'."""
        return f"{self.trajectories_dir}/{check_name(stage, 'layer')}/{check_name(worker, 'worker id')}"

    def shard(self, stage: str, worker: str, seq: int) -> str:
        return self.shard_in(self.shard_dir(stage, worker), seq)

    def writer_claim(self, worker: str) -> str:
        """The claim of the one live writer of `worker`'s shards (areal_core/writer_claim.py)."""
        return f"{self.writers_dir}/{check_name(worker, 'worker id')}.json"

    @staticmethod
    def shard_in(worker_dir: str, seq: int) -> str:
        """Shard `seq` of a worker folder of any layer (a run's, a re-graded one, a sessions store's)."""
        return f"{worker_dir}/{seq:08d}.arrow"

    def ungraded_shard(self, worker: str, seq: int) -> str:
        return self.shard("ungraded", worker, seq)

    def graded_shard(self, worker: str, seq: int) -> str:
        return self.shard("graded", worker, seq)

    def graded_twin(self, ungraded: str) -> str:
        """The graded shard a reward worker writes for an ungraded one (same worker and seq)."""
        return ungraded.replace(f"{self.ungraded_dir}/", f"{self.graded_dir}/", 1)

    def ungraded_twin(self, graded: str) -> str:
        return graded.replace(f"{self.graded_dir}/", f"{self.ungraded_dir}/", 1)

    def layer_dir(self, layer: str) -> str:
        """'graded' / 'ungraded' -> the run's own layer; any other name -> a re-graded layer under
        trajectories/regraded/ (a name that is not a plain folder name: ValueError)."""
        if layer in self.base_layers:
            return f"{self.trajectories_dir}/{layer}"
        check_name(layer, "layer name")
        if not _LAYER_NAME.fullmatch(layer):
            raise ValueError(
                f"layer name {layer!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit (it becomes a folder name)"
            )
        return f"{self.regraded_dir}/{layer}"

    def layer_shard(self, layer: str, worker: str, seq: int) -> str:
        return f"{self.layer_dir(layer)}/{check_name(worker, 'worker id')}/{seq:08d}.arrow"

    def in_layer(self, rel: str, source: str, layer: str) -> str:
        """The path in `layer` of the shard `rel` of layer `source`, under the same worker folder
        and file name, whatever that name is: 'trajectories/graded/w/copy-of-1.arrow' ->
        'trajectories/regraded/L/w/copy-of-1.arrow'. ValueError when `rel` is not in `source`."""
        prefix = self.layer_dir(source) + "/"
        if not rel.startswith(prefix):
            raise ValueError(f"{rel!r} is not a shard of layer {source!r}")
        return self.layer_dir(layer) + "/" + rel[len(prefix) :]

    regrade_record_name = "REGRADE.json"
    regrade_changes_name = "changes.parquet"

    def regrade_record(self, layer: str) -> str:
        """A re-graded layer's request (written first) and, when done, its summary."""
        return f"{self.layer_dir(layer)}/{self.regrade_record_name}"

    def regrade_changes(self, layer: str) -> str:
        """The rewards a re-grade changed: identity, worker_id, sample_id, old and new reward."""
        return f"{self.layer_dir(layer)}/{self.regrade_changes_name}"

    @staticmethod
    def shard_worker_seq(rel: str) -> tuple[str, int]:
        """'trajectories/graded/proxy-0/00000041.arrow' -> ('proxy-0', 41)."""
        parts = rel.split("/")
        return parts[-2], int(parts[-1].split(".")[0])

    @staticmethod
    def shard_worker(rel: str) -> str:
        """The worker whose folder holds shard `rel`, whatever the file is named."""
        return rel.rsplit("/", 2)[-2]

    @staticmethod
    def shard_seq(rel: str) -> int | None:
        """The sequence number a writer gave shard `rel` ('.../00000041.arrow' -> 41); None for
        any other name the store holds ('copy-of-1.arrow', '1 (2).arrow'): readers keep such a
        shard's rows but never take a position from its name."""
        stem = rel.rsplit("/", 1)[-1].removesuffix(".arrow")
        return int(stem) if _SEQ.fullmatch(stem) else None

    # -- trainer ---------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> str:
        return f"{self.checkpoints_dir}/{self.step_prefix}{step:06d}"

    def checkpoint_file(self, step: int, name: str) -> str:
        """A file of checkpoint `step`: model.safetensors, optimizer.pt, pending.arrow, state.json, ..."""
        return f"{self.checkpoint_dir(step)}/{name}"

    def checkpoint_step(self, name: str) -> int | None:
        """'step-000012' (an entry of trainer/checkpoints/) -> 12; None for anything else."""
        return self._numbered(name, self.step_prefix)

    def committed(self, folder: str) -> str:
        """The marker that makes `folder` (a checkpoint, init_model, final_model) visible."""
        return f"{folder}/{self.committed_name}"

    def trained_record(self, step: int) -> str:
        return f"{self.trained_dir}/{self.step_prefix}{step:06d}.json"

    def trained_step(self, name: str) -> int | None:
        """'step-000012.json' (an entry of trainer/trained/) -> 12; None for anything else."""
        return self._numbered(name.removesuffix(".json"), self.step_prefix) if name.endswith(".json") else None

    def drop_record(self, step: int) -> str:
        """The samples dropped since the previous checkpoint, written with checkpoint `step`."""
        return f"{self.drops_dir}/{self.step_prefix}{step:06d}.json"

    def drop_step(self, name: str) -> int | None:
        """'step-000012.json' (an entry of trainer/drops/) -> 12; None for anything else."""
        return self.trained_step(name)

    def fork_child(self, child_id: str) -> str:
        """In a forked run: the record of one fork made of it."""
        return f"{self.fork_children_dir}/{check_name(child_id, 'fork id')}.json"

    def own_folders(self, role: str, index: int = 0) -> tuple[str, ...]:
        """The folders a role writes and so sweeps of stale temporary files at start
        (Store.clean_temp): the trainer, which owns the run, the whole root; a rollout worker its
        ungraded shards; the reward workers the graded layer; SFT the initial model."""
        if index < 0:
            raise BadName(f"worker index {index} must be >= 0")
        return {
            "trainer": ("",),
            "rollout": (self.shard_dir("ungraded", f"rollout-{index}"),),
            "reward": (self.graded_dir,),
            "sft": (self.init_model,),
        }.get(role, ())

    # -- status, quarantine, labels, online ------------------------------------------------------
    def status(self, role: str, worker_id: str) -> str:
        return f"{self.status_dir}/{check_name(role, 'role')}-{check_name(worker_id, 'worker id')}.json"

    def weights_fault(self, worker_id: str) -> str:
        return f"{self.weights_faults_dir}/{check_name(worker_id, 'worker id')}.json"

    def reader_retired(self, worker_id: str) -> str:
        return f"{self.readers_retired_dir}/{check_name(worker_id, 'worker id')}.json"

    def events_part(self, role: str, worker_id: str, seq: int) -> str:
        return f"{self.events_dir}/{check_name(role, 'role')}-{check_name(worker_id, 'worker id')}/{seq:08d}.jsonl"

    def quarantined(self, rel: str) -> str:
        """Where a bad shard `rel` is moved: quarantine/ with its path flattened ("/" to "__"). Where
        that name could stand for two paths (`rel` holds "__") or is too long for a file system, the
        name is cut and ends in a digest of `rel` instead, so no quarantine overwrites another's."""
        flat = rel.replace("/", "__")
        if "__" in rel or len(flat.encode()) > QUARANTINE_NAME_BYTES:
            digest = hashlib.sha256(rel.encode()).hexdigest()[:16]
            head = flat.encode()[: QUARANTINE_NAME_BYTES - 48].decode(errors="ignore")
            flat = f"{head}.{digest}{posixpath.splitext(rel)[1][:16]}"
        return f"{self.quarantine_dir}/{flat}"

    @staticmethod
    def quarantine_reason(quarantined: str) -> str:
        return quarantined + ".reason.json"

    def labels_file(self, name: str) -> str:
        return f"{self.labels_dir}/{check_name(name, 'labels file name')}"

    def online_run(self, run_id: str) -> str:
        return f"{self.online_dir}/{check_name(run_id, 'online run id')}"

    def online_consumed(self, run_id: str) -> str:
        """In a sessions store: the identities of the samples online run `run_id` trained on."""
        return f"{self.online_consumed_dir}/{check_name(run_id, 'online run id')}.txt.gz"


LAYOUT = Layout()
