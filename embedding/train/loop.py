"""The DLRM training loop: sharded embeddings, data-parallel dense layers, one step at a time.

One step of batch ``i`` (module :mod:`embedding.train.step` times each part)
runs under the loop's :class:`~collectives.control.StepControl`: every rank
agrees the step's shape once, and while it holds the step's collectives
replay their plans without agreeing each call::

    wait for the input dist of batch i; local lookup; output dist  -> pooled [B, F * D]
    read batch i+1 and start its input dist          (with overlap: hidden behind the rest)
    dense forward + backward; gradient buckets AllReduce as they complete (with overlap)
    agree: the global loss, and whether any rank saw bad data or a non-finite tensor
    embedding backward: reverse output dist + fused sparse optimizer
    wait for the dense AllReduce (mean over ranks); dense optimizer

The embeddings get ``d loss / d pooled`` divided by the world size, so with
the same global batch and seed 1, 2 or 4 ranks follow the same loss curve.
Nothing is updated in a step whose agreement fails: every rank raises the
same :class:`~embedding.train.types.TrainingError` naming the step and the
tensor, and the last checkpoint stays the latest.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collectives.control import StepControl
from embedding.dense import DenseConfig, DenseModel, NonFiniteError, make_optimizer
from embedding.dense.metrics import bce_with_logits
from embedding.precision import quality_warning
from embedding.train.data import GuardedDataset, TrainData, filler_batch, open_data
from embedding.train.metrics import MetricsLog
from embedding.train.progress import ProgressBar
from embedding.train.setup import (check_disk_room, fail_together, id_policy_of,
                                   make_plan, make_reader, tables_of)
from embedding.train.state import checkpoint_bytes
from embedding.train.step import (EmbeddingStages, GradSync, PhaseTimer, finite,
                                  symmetric_grads)
from embedding.train.types import ConfigError, DataSource, Phase, TrainConfig, TrainingError

__all__ = ["Trainer", "TrainResult", "PreparedBatch"]

_log = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """A local batch ready for its input dist, the reader position before it, its problem."""

    batch: object
    kjt: object
    position: dict
    problem: Exception | None = None


@dataclass(frozen=True)
class TrainResult:
    """What a run did: ``steps`` done in all (resumed ones included), this run's wall time."""

    step: int
    steps_run: int
    samples: int
    seconds: float
    loss: float | None
    auc: float | None
    log_loss: float | None
    planted_auc: float | None
    metrics_path: Path | None
    checkpoint: Path | None


class Trainer:
    """Trains ``config`` on ``group`` (default: the world); every rank builds one.

    ``data`` replaces the data sets of ``config.data`` (tests, custom
    sources); without training records (``data.train`` None) it can only
    evaluate and score. ``stream`` receives rank 0's progress and messages
    (default stdout). ``outputs=False`` writes nothing (no metrics log, no
    checkpoints, no output directory checks): for scoring with a trained model, or
    training to compare. Construction
    agrees every fallible step across the group.
    """

    def __init__(self, config: TrainConfig, group=None, *, data: TrainData | None = None,
                 stream=None, outputs: bool = True):
        from neocomm.world import group_or_world

        from embedding.train.batching import resolve_batches

        group = group_or_world(group)
        self.group = group
        self.rank, self.size = int(group.rank), int(group.size)
        self.step = 0
        #: train.batch_size as configured (0: the default, fitted to the ranks)
        self.given_batch = config.train.batch_size
        self._given_eval_batch = config.train.eval_batch_size
        exc = None
        try:
            config = resolve_batches(config, self.size)
            if data is None:
                data = open_data(config, group)
        except (ConfigError, ValueError, OSError) as e:
            exc = e
        fail_together(group, "opening the data", exc)
        self.cfg = config
        tr = config.train
        self.data = data
        self._setup_threads()
        self.tables = tables_of(config, data)
        if self.rank == 0:
            notes = {quality_warning(t.dtype, t.rounding, t.optimizer_state_dtype,
                                     t.optimizer.kind) for t in self.tables} - {None}
            for note in sorted(notes):
                _log.warning(note)
        self.plan = make_plan(config, self.tables, group, data.ids_per_sample)
        m = config.model
        self.dense_config = DenseConfig(num_dense=data.num_dense,
                                        num_sparse=len(data.feature_names),
                                        bottom_mlp=m.bottom_mlp, top_mlp=m.top_mlp,
                                        dtype=m.dtype)
        out = Path(config.output.dir)
        self.out_dir = out
        self.checkpoint_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else \
            out / "checkpoints"
        dense_params = sum(i * o + o for _, i, o in self.dense_config.layer_shapes())
        self.outputs = outputs
        if outputs:
            check_disk_room(group, [out, self.checkpoint_dir],
                            checkpoint_bytes(self.plan, self.tables, self.rank, dense_params))
        from embedding.collection import ShardedEmbeddingCollection

        self.coll = ShardedEmbeddingCollection(
            self.tables, self.plan, group, device=tr.device, dtype=config.model.dtype,
            threads=self.threads,
            dedup=tr.dedup, id_policy=id_policy_of(config), seed=tr.seed,
            qcomms=config.comms.qcomms())
        self.model = DenseModel(self.dense_config, seed=tr.seed, xp=self.coll.xp,
                                bucket_bytes=tr.bucket_kib << 10,
                                grad_alloc=symmetric_grads(group, self.coll.xp))
        self.optimizer = make_optimizer(config.dense_optimizer)
        self.stages = EmbeddingStages(self.coll)
        # from the plan, the same on every rank (a rank may hold no host-resident shard)
        self._tiered = any(tp.memory.tiered for tp in self.plan.tables)
        self.overlap = tr.overlap
        from embedding.sharding.qcomm import CommPrecision, Wire

        self.grads = GradSync(self.model, group, overlap=tr.overlap,
                              wire=Wire(CommPrecision(config.comms.dense), self.coll.xp,
                                        config.model.dtype, scale=config.comms.dense_scale(),
                                        key="comms.dense"))
        self.timer = PhaseTimer()
        # one agreement per step: its calls replay their plans unagreed while the shape holds
        self.control = StepControl(group, "training step")
        self._guard = self.reader = None
        if data.train is not None:
            self._guard = GuardedDataset(data.train, data.num_dense, data.feature_names)
            self.reader = self._make_reader()
        self._check_sizes = (data.table_sizes if config.tables.id_policy == "error"
                             and not config.tables.dynamic else None)
        self.metrics = MetricsLog(out / "metrics.jsonl", enabled=outputs and self.rank == 0)
        self.progress = ProgressBar(tr.steps, stream=stream, every=tr.log_every,
                                    enabled=self.rank == 0)
        self.losses: list[tuple[int, float]] = []  # (step, global mean loss) of this run
        self.last_eval: dict | None = None
        self.last_checkpoint: Path | None = None
        self.planted_auc: float | None = None
        self._pending = None  # (PreparedBatch, DistributedBatch) of the next step

    # -- setup -------------------------------------------------------------------
    def _setup_threads(self) -> None:
        from embedding.train.threads import limit_blas_threads, rank_threads, ranks_on_host

        n = rank_threads(self.cfg.train.threads, ranks_on_host(self.group.size))
        limit_blas_threads(n)
        self.threads = n

    def _make_reader(self):
        cfg = self.cfg
        return make_reader(self._guard, cfg.train.batch_size, self.group,
                           broadcast=cfg.data.broadcast, shuffle=cfg.data.shuffle,
                           seed=cfg.train.seed, feature_names=self.data.feature_names,
                           shuffle_window=cfg.data.window)

    def use_batch(self, batch: int) -> None:
        """Train with the global batch ``batch`` from here on (a multiple of the ranks): a
        run on the default batch resuming a checkpoint written with another one."""
        import dataclasses

        tr = self.cfg.train
        evb = self._given_eval_batch or batch
        self.cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(
            tr, batch_size=int(batch), eval_batch_size=int(evb)))
        if self.reader is not None:
            self.reader = self._make_reader()

    def describe_plan(self) -> dict[str, list[str]]:
        """``{sharding type: [tables]}`` of the plan."""
        out: dict[str, list[str]] = {}
        for tp in self.plan.tables:
            out.setdefault(tp.sharding.value, []).append(tp.table)
        return out

    def state_expectations(self) -> dict:
        """What a checkpoint must record to be loaded into this model."""
        return {"dense": {"layers": [list(x) for x in self.dense_config.layer_shapes()],
                          "dtype": self.dense_config.dtype},
                "sparse_optimizer": self.cfg.sparse_optimizer.kind.value,
                "dense_optimizer": self.cfg.dense_optimizer.kind.value}

    # -- data ----------------------------------------------------------------------
    def prepare(self, reader, guard, step: int, timer: PhaseTimer) -> PreparedBatch:
        """Read this rank's slice of the next batch of ``reader`` for ``step`` and check it.

        A batch that fails to read or to check becomes a filler batch and
        its problem travels with it to the step's agreement.
        """
        with timer(Phase.DATA):
            position = reader.state_dict()
            batch = reader.next()
            problem = guard.take()
            if problem is None:
                try:
                    batch.check(step=step, table_sizes=self._check_sizes)
                except (ValueError, FloatingPointError) as exc:  # BatchError, NonFiniteError
                    problem = exc
            if problem is not None:
                batch = filler_batch(batch.batch_size, self.data.num_dense,
                                     self.data.feature_names)
            kjt = batch.to_jagged()
        return PreparedBatch(batch, kjt, position, problem)

    def _start(self, step: int):
        prep = self.prepare(self.reader, self._guard, step, self.timer)
        with self.timer(Phase.INPUT_DIST):
            dist = self.stages.start(prep.kjt)
        return prep, dist

    # -- one step ------------------------------------------------------------------
    def _step(self, prep: PreparedBatch, dist, step: int, has_next: bool) -> float:
        """Train on ``prep``; returns the global mean loss. Starts the next input dist."""
        timer = self.timer
        pooled, ctx = self.stages.forward(dist, timer)
        if self.overlap and has_next:
            self._pending = self._start(step + 1)
        batch = prep.batch
        b, f = batch.batch_size, len(self.data.feature_names)
        with timer(Phase.DENSE):
            xp = self.model.xp
            logits = self.model.forward(xp.asarray(batch.dense),
                                        pooled.reshape(b, f, self.cfg.model.embedding_dim))
            loss, dlogits = bce_with_logits(logits, xp.asarray(batch.labels))
            d_pooled = self.model.backward(dlogits, hook=self.grads.hook())
        if self._pending is not None and self._tiered:
            with timer(Phase.INPUT_DIST):  # the next batch's host-resident rows come in now
                self.coll.prefetch(self._pending[1])
        with timer(Phase.SYNC):
            loss = self._agree_step(step, loss, d_pooled, prep.problem)
        d_pooled = d_pooled.reshape(b, -1)
        if self.size > 1:
            d_pooled *= d_pooled.dtype.type(1.0 / self.size)
        self.stages.backward(d_pooled, ctx, timer)
        self.grads.finish(timer)
        if not finite(self.model.flat_grads):  # the same on every rank after the AllReduce
            self._drain()
            c = self.cfg.comms
            hint = (f" (comms.dense = \"fp16\" with comms.loss_scale = {c.loss_scale:g}: a "
                    f"scaled sum beyond fp16's 65504 overflows; lower comms.loss_scale or use "
                    f"\"bf16\")" if c.dense == "fp16" else "")
            err = TrainingError(f"step {step}: the dense gradients (after the AllReduce) hold "
                                f"NaN or inf{hint}; stopping before the dense update",
                                step=step, tensor="dense_grads")
            err.agreed = True
            raise err
        with timer(Phase.OPTIMIZER):
            self.optimizer.step(self.model.flat_params, self.model.flat_grads)
        if not self.overlap and has_next:
            self._pending = self._start(step + 1)
        return loss

    def _cache_record(self, steps: int, seconds: float) -> dict:
        """The host-resident tables' counters since the last record, over every rank
        (collective): hit rate of the ids looked up and of each step's distinct rows, bytes
        per step each way, mean ms per step per rank in cache work and its share of the step."""
        import collectives

        s = self.coll.take_cache_stats()
        buf = np.array([s.lookups, s.hits, s.bytes_in, s.bytes_out, s.seconds, s.accesses,
                        s.access_hits], np.float64)
        if self.size > 1:
            collectives.all_reduce(buf, group=self.group)
        ms = 1e3 * buf[4] / self.size / steps
        return {"hit_rate": round(buf[6] / buf[5], 4) if buf[5] else 0.0,
                "row_hit_rate": round(buf[1] / buf[0], 4) if buf[0] else 0.0,
                "lookups_per_step": int(buf[0] // steps),
                "h2d_bytes_per_step": int(buf[2] // steps),
                "d2h_bytes_per_step": int(buf[3] // steps),
                "ms_per_step": round(ms, 3),
                "step_share": round(ms / (1e3 * seconds / steps), 4) if seconds > 0 else 0.0}

    def _agree_step(self, step: int, loss, d_pooled, problem) -> float:
        """One AllReduce: the global loss, and whether any rank has a problem."""
        import collectives

        value = float(np.asarray(loss.get() if hasattr(loss, "get") else loss))
        if problem is None:
            try:
                if not np.isfinite(value):
                    raise NonFiniteError(f"step {step}: loss is {value}", step=step,
                                         tensor="loss")
                if not finite(d_pooled):
                    raise NonFiniteError(f"step {step}: the gradient of the pooled embeddings "
                                         f"holds NaN or inf (the loss is {value})", step=step,
                                         tensor="d_pooled")
            except NonFiniteError as exc:
                problem = exc
        buf = np.array([value if problem is None else 0.0, 0.0 if problem is None else 1.0])
        if self.size > 1:
            collectives.all_reduce(buf, group=self.group)
        if buf[1] > 0:
            self._drain()
            fail_together(self.group, "training", problem, step=step)
        return float(buf[0] / self.size)

    def _drain(self) -> None:
        """Finish the collectives in flight, so every rank can stop cleanly."""
        self.grads.drain()
        if self._pending is not None:
            _, dist = self._pending
            for p in dist.pending:
                p.wait()
            self._pending = None

    # -- the run ---------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train up to ``config.train.steps`` steps, evaluating and checkpointing on the way."""
        from embedding.train.config import config_to_dict

        cfg = self.cfg.train
        total = cfg.steps
        start_step = self.step
        if self.data.planted is not None and self.rank == 0 and self.planted_auc is None:
            self.planted_auc = self._planted_auc()
        self.metrics.write("start", step=start_step, world_size=self.size,
                           config=config_to_dict(self.cfg), plan=self.describe_plan(),
                           planted_auc=self.planted_auc, threads=self.threads)
        t_run = time.perf_counter()
        t_log, n_log, losses = t_run, 0, []
        loss = None
        self.timer.reset()
        while self.step < total:
            loss = self.run(1, horizon=total)[0]
            step = self.step
            losses.append(loss)
            n_log += 1
            now = time.perf_counter()
            rate = cfg.batch_size * (self.step - start_step) / max(now - t_run, 1e-9)
            self.progress.update(step, loss, rate, (total - step) * (now - t_run) /
                                 (self.step - start_step))
            if step % cfg.log_every == 0 or step == total:
                phases = self.timer.reset()
                dt = now - t_log
                extra = {"cache": self._cache_record(n_log, dt)} if self._tiered else {}
                sent = self.coll.take_sent()
                extra["comm_bytes"] = {"emb_forward": sent["forward"] // n_log,
                                       "emb_backward": sent["backward"] // n_log,
                                       "dense": (self.grads.take_sent() + sent["dense"])
                                       // n_log}
                calls = self.coll.take_calls()
                extra["emb_calls"] = {k: round(v / n_log, 3) for k, v in calls.items()}
                self.metrics.write("train", step=step, loss=loss,
                                   loss_avg=float(np.mean(losses)),
                                   samples_per_s=cfg.batch_size * n_log / max(dt, 1e-9),
                                   step_ms=1e3 * dt / n_log,
                                   phases_ms={p.value: round(1e3 * s / n_log, 3)
                                              for p, s in phases.items()}, **extra)
                t_log, n_log, losses = now, 0, []
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                self._evaluate_and_log()
                t_log = time.perf_counter()
            every = self.cfg.checkpoint.every if self.outputs else 0
            if every and step % every == 0 and step < total:
                self.save()
                t_log = time.perf_counter()
        seconds = time.perf_counter() - t_run
        self.progress.close()
        if self.step > start_step or self.last_eval is None:
            self._evaluate_and_log()
        if self.outputs and (self.step > start_step or self.last_checkpoint is None):
            self.save()
        samples = (self.step - start_step) * cfg.batch_size
        ev = self.last_eval or {}
        self.metrics.write("end", step=self.step, seconds=round(seconds, 3), samples=samples,
                           auc=ev.get("auc"), log_loss=ev.get("log_loss"))
        return TrainResult(self.step, self.step - start_step, samples, seconds, loss,
                           ev.get("auc"), ev.get("log_loss"), self.planted_auc,
                           self.metrics.path if self.rank == 0 else None, self.last_checkpoint)

    def run(self, steps: int, *, horizon: int | None = None) -> list[float]:
        """Train ``steps`` more steps without evaluating or checkpointing; their global losses.

        Batches up to step ``horizon`` (default: the last of these steps) are
        read ahead, so consecutive calls keep the input dist overlapped.
        """
        horizon = self.step + steps if horizon is None else max(horizon, self.step + steps)
        out = []
        for _ in range(steps):
            step = self.step + 1
            if self._pending is None:
                self._pending = self._start(step)
            prep, dist = self._pending
            self._pending = None
            with self.control.step(batch_size=prep.batch.batch_size, tables=len(self.tables),
                                   dense=self.data.num_dense):
                loss = self._step(prep, dist, step, has_next=step < horizon)
            self.step = step
            self.losses.append((step, loss))
            out.append(loss)
        return out

    def set_overlap(self, on: bool) -> None:
        """Turn the overlap of the input dist and of the dense AllReduce on or off."""
        self.overlap = bool(on)
        self.grads.overlap = bool(on)

    def _evaluate_and_log(self) -> dict:
        ev = self.evaluate()
        self.coll.take_sent()  # the step records count training steps only
        self.coll.take_calls()
        self.last_eval = ev
        self.progress.auc = ev["auc"]
        self.metrics.write("eval", step=self.step, **ev)
        self.progress.message(f"step {self.step}: " + describe_eval(ev))
        return ev

    def close(self, drain: bool = True) -> None:
        """Finish what is in flight (every rank calls it) and close the outputs.

        ``drain=False`` skips waiting for the collectives in flight: for a rank
        leaving on an error the others did not see (the job is then aborted).
        """
        if drain:
            self._drain()
        self.progress.close()
        self.metrics.close()

    # -- evaluation, checkpoints (embedding/train/evaluate.py, embedding/train/save.py) --
    def evaluate(self) -> dict:
        """AUC and log-loss on the held-out records, gathered over every rank."""
        from embedding.train.evaluate import evaluate

        return evaluate(self)

    def _planted_auc(self) -> float | None:
        from embedding.train.evaluate import planted_auc

        return planted_auc(self)

    def save(self) -> Path:
        """Write the checkpoint of the current step (every rank; agreed)."""
        from embedding.train.save import save

        self.last_checkpoint = save(self)
        return self.last_checkpoint

    def resume(self, where: str) -> int:
        """Load ``where`` (a checkpoint, ``latest`` or ``auto``); returns the step resumed at."""
        from embedding.train.save import resume

        return resume(self, where)


def describe_eval(ev: dict, thousands: bool = False) -> str:
    """``valid AUC 0.7712, log-loss 0.4621, accuracy 0.7890 (10000 records); test ...``."""
    parts = []
    for name, m in (ev.get("sets") or {"held-out": ev}).items():
        records = f"{m['records']:,}" if thousands else str(m["records"])
        text = f"{name} AUC {m['auc']:.4f}, log-loss {m['log_loss']:.4f}"
        if "accuracy" in m:
            text += f", accuracy {m['accuracy']:.4f}"
        parts.append(f"{text} ({records} records)")
    return "; ".join(parts)


def data_source_name(cfg: TrainConfig) -> str:
    """``synthetic`` or the files read, for messages."""
    if cfg.data.source is DataSource.SYNTHETIC:
        return f"synthetic ({cfg.data.records} records, seed {cfg.train.seed})"
    return ", ".join(cfg.data.path)
