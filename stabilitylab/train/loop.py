"""The training loop on HF accelerate: the arms of a run, one after the other, then the report.

    result = run(cfg)            # every arm of cfg; {arm: summary}

The arms are the stress study's ``softmax`` / ``sigmoid`` (cells) or the KV-eviction study's
cells (text); each trains with its own config, ``cfg.arm_config(arm)``. Each arm starts from the
same initial weights where the parameters coincide (seeded construction; the gates draw no random
number; checked by hash for the stress arms) and sees the same data in the same order
(``stabilitylab.data.loader``). Every step reads as

    batch (DataLoader) -> step (``step.train_step``, validation when due, one host read) ->
    telemetry (history, trackers) -> policy (``policy.Policy``: non-finite steps, the divergence
    rule) -> checkpoint

and SIGTERM / SIGINT stop the loop at the end of a step, after a checkpoint.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stabilitylab import runs
from stabilitylab.attention import sdpa_kernels
from stabilitylab.config import Config, ConfigError
from stabilitylab.data import build_source
from stabilitylab.data.batch import Batch
from stabilitylab.data.loader import step_loader
from stabilitylab.kernels import autotune_choices
from stabilitylab.model import count_parameters
from stabilitylab.telemetry import (
    StepTelemetry,
    end_trackers,
    first_nonfinite_module,
    missing_trackers,
    start_trackers,
)
from stabilitylab.train import build, checkpoint, resume, sharding, warmstart
from stabilitylab.train.policy import History, Policy
from stabilitylab.train.step import StepNumbers, read_numbers, train_step, validation_sums
from stabilitylab.train.task import TaskData, cell_task, text_task


class Stopper:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and returns."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, accelerator) -> bool:
        """Whether the run stops after this step: on several processes, whether any of them was
        signalled (a one-number all-reduce). Each process is signalled on its own, at times a
        step apart; one that stopped alone would wait in the checkpoint's collectives while the
        others wait in the next step's."""
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def check(cfg: Config, world: int, cuda: bool) -> None:
    """Refuse, before any work, what the dataclass checks cannot see (installed packages, the
    launcher's precision, the process count)."""
    if cfg.fresh and cfg.resume == "force":
        raise ConfigError("config fresh: --fresh=True starts over; it contradicts --resume=force")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise ConfigError(f"config num_workers: must be >= 0 or None, got {cfg.num_workers}")
    missing = missing_trackers(cfg.trackers)
    if missing:
        raise ConfigError(f"config trackers: {', '.join(missing)} not installed (pip install it)")
    build.mixed_precision(cfg, cuda)
    build.accumulation_steps(cfg, world)
    sharding.check(cfg)
    if cfg.task == "lm":
        # The cells own these two keys; an override would be replaced without a word.
        if cfg.model.gates:
            raise ConfigError(
                "config model.gates: each cell sets it (the -g- cells are gated); leave it False "
                "and pick cells with --cells"
            )
        if cfg.model.position != "rope":
            raise ConfigError(
                "config model.position: each cell sets it (-rope: rope, -nope: none); leave it "
                "rope and pick cells with --cells"
            )
    for arm in cfg.arms():
        cfg.arm_config(arm)  # a cell's own settings are checked too (e.g. rope's even head dim)
    warmstart.check_sources(cfg)  # train.init_from and the -ft cells' backbones on disk


def open_data(cfg: Config) -> TaskData:
    """The run's data, opened once for all its arms; bad data raises ``DataError`` here."""
    if cfg.task == "lm":
        return text_task(cfg)
    return cell_task(build_source(cfg.data, cfg.train.seed), cfg)


@dataclass
class Arm:
    """One arm in training: what the loop and its end need."""

    cfg: Config
    name: str
    dir: Path
    backend: str
    config: dict
    trainee: build.Trainee
    tel: StepTelemetry
    hist: History
    start: int
    init_hash: str
    n_params: int
    val: list[Batch]
    """This process's share of the fixed validation batches (the next-token task)."""
    validates: bool
    """The run has validation batches: every process joins each pass, even with no share."""
    policy: Policy | None = None
    wall_base: float = 0.0
    """Training time of the segments before this one (from the checkpoint)."""
    wall_start: float = 0.0
    """time.time() when this segment's loop started."""

    @property
    def accelerator(self):
        return self.trainee.accelerator

    def say(self, msg: str) -> None:
        self.accelerator.print(f"[{self.name}] {msg}")

    def tick(self, hist: History) -> None:
        """Training time so far, all segments summed, into ``hist``."""
        hist.wall_time_s = self.wall_base + time.time() - self.wall_start

    def val_due(self, step: int) -> bool:
        """Validation after step 0, every ``telemetry.val_every`` steps and after the last."""
        every = self.cfg.telemetry.val_every
        return (
            self.validates and every > 0 and (step % every == 0 or step == self.cfg.train.steps - 1)
        )

    def record(self, step: int, numbers: StepNumbers) -> None:
        """The step's numbers into the history the policy reads and the checkpoint keeps."""
        self.hist.append(step, numbers.loss, numbers.grad_norm, numbers.max_LH)
        if numbers.val_loss is not None:
            self.hist.append_val(step, numbers.val_loss)
        if numbers.terms_2 is not None:
            self.hist.last["ce_loss"], self.hist.last["budget_loss"] = numbers.terms_2
        if numbers.gate_3L is not None:
            mean_L, low_L, high_L = numbers.gate_3L
            self.hist.last["gate_mean"] = sum(mean_L) / len(mean_L)
            self.hist.last["gate_frac_binary"] = (sum(low_L) + sum(high_L)) / len(mean_L)
            self.hist.gate_mean_L = list(mean_L)

    def save(self, name: str, step: int, hist: History, extra: dict | None = None) -> None:
        self.tick(hist)
        checkpoint.save(
            self.dir / "checkpoints",
            name,
            self.accelerator,
            self.trainee.model,
            self.trainee.optimizer,
            step=step,
            history=hist.to_dict(),
            config=self.config,
            extra=extra,
        )


def _start(cfg: Config, arm: str, data: TaskData, state) -> tuple[resume.Start, str, dict]:
    """Plan the arm's start on the main process (it alone reads and hashes the checkpoint), share
    the plan, and prepare the arm dir for it."""
    from accelerate.utils import broadcast_object_list

    cuda = torch.cuda.is_available()
    backend = cfg.backend_for(arm, cuda)
    precision = build.mixed_precision(cfg, cuda)[0]
    config = runs.resolved_config(cfg, arm, backend, precision, data.facts)
    d = runs.arm_dir(cfg, arm)
    plan = [None]
    if state.is_main_process:
        try:
            plan[0] = resume.plan(cfg, d, config, sharded=sharding.requested())
        except (resume.ResumeError, checkpoint.CheckpointError) as e:
            plan[0] = e
    plan = broadcast_object_list(plan)[0] if state.num_processes > 1 else plan[0]
    if isinstance(plan, Exception):
        raise plan
    if state.is_main_process and plan.kind == "fresh":
        runs.start_arm(d, config, data.vocab)
    elif state.is_main_process and plan.kind == "resume":
        runs.record_resume(d, plan.step, plan.changes)
    state.wait_for_everyone()
    return plan, backend, config


def _build_arm(cfg, arm, data: TaskData, accelerator, plan, backend, config) -> Arm:
    model = build.build_model(cfg, backend, data.vocab_size)
    init = warmstart.load_init(model, cfg, arm) if plan.kind == "fresh" else None
    init_hash, n_params = build.weights_hash(model), count_parameters(model)
    accum = build.accumulation_steps(cfg, accelerator.num_processes)
    trainee = build.prepare(cfg, accelerator, model, accum)
    hist = History()
    if plan.kind == "resume":
        _, hist_dict = checkpoint.load(
            plan.checkpoint, accelerator, trainee.model, trainee.optimizer, verified=True
        )
        hist = History(**hist_dict)
    d = runs.arm_dir(cfg, arm)
    tel = StepTelemetry(
        cfg, trainee.raw, world=accelerator.num_processes, cuda=accelerator.device.type == "cuda"
    )
    val = data.val[accelerator.process_index :: accelerator.num_processes]
    a = Arm(
        cfg, arm, d, backend, config, trainee, tel, hist, plan.step, init_hash, n_params,
        val=val, validates=bool(data.val),
    )  # fmt: skip
    a.policy = Policy(cfg, hist, a.save, a.say)
    sharded = " sharded=FSDP2" if sharding.is_sharded(trainee.model) else ""
    a.say(
        f"backend={backend} params={n_params / 1e6:.1f}M init_hash={init_hash} "
        f"processes={accelerator.num_processes}{sharded} accumulation={accum} "
        f"micro_batch={cfg.train.micro_batch} mixed_precision={accelerator.mixed_precision}"
    )
    if plan.kind == "resume":
        changed = f" with changed config: {resume.describe(plan.changes)}" if plan.changes else ""
        a.say(f"resumed from {plan.checkpoint} at step {plan.step}{changed}")
    if init is not None:
        a.say(f"starts from the weights of {init['checkpoint']} (step {init['step']})")
        if accelerator.is_main_process:
            runs.add_provenance(d, init_from=init)
    return a


class Progress:
    """tqdm bar on the main process only."""

    def __init__(self, a: Arm):
        self.bar = None
        if a.accelerator.is_main_process:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=a.cfg.train.steps,
                initial=a.start,
                desc=a.name,
                dynamic_ncols=True,
                mininterval=2.0,
            )

    def update(self, step: int, numbers, step_time_s: float) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if step % 10 == 0:
            tok_s = numbers.n_tokens / step_time_s
            self.bar.set_postfix(
                loss=f"{numbers.loss:.3f}", gn=f"{numbers.grad_norm:.2g}", tok_s=f"{tok_s:.3g}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _loop(a: Arm, loader, stopper: Stopper, progress: Progress) -> int:
    """Train from ``a.start``; returns the number of steps done when the loop ends."""
    batches = iter(loader)
    try:
        return _steps(a, batches, stopper, progress)
    finally:
        close_batches(batches)


def close_batches(batches) -> None:
    """Stop a loader iterator's workers now. They ignore SIGTERM (``data.loader``), and an
    exception's traceback keeps the iterator alive until the interpreter exits, where
    multiprocessing's exit handler would wait on them forever: a crash would hang, not exit."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # the multi-worker iterator's own
    if shutdown is not None:
        shutdown()


def _steps(a: Arm, batches, stopper: Stopper, progress: Progress) -> int:
    cfg, t, device = a.cfg, a.trainee, a.accelerator.device
    per_rank = cfg.train.global_batch // t.world
    step = a.start
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        data = next(batches).to(device, non_blocking=True)
        lam = build.budget_lambda_at(cfg, step)
        out = train_step(t, data, build.lr_at(cfg, step), cfg.train.clip_grad, a.tel, lam)
        if a.val_due(step):
            out.val_2 = validation_sums(t, a.val)
        numbers = read_numbers(out)
        dt = time.perf_counter() - t0

        a.record(step, numbers)
        scalars = a.tel.scalars(
            step, numbers, data, dt, build.lr_at(cfg, step), t.raw, a.accelerator.is_main_process
        )
        if scalars:
            a.accelerator.log(scalars, step=step)

        stop = a.policy.after_step(
            step,
            numbers.loss,
            numbers.grad_norm,
            locate=lambda b=data.micro[0]: first_nonfinite_module(
                t.raw, lambda: t.raw(b.tokens_BT, b.lengths_B)
            ),
            batch=[data.first_index, per_rank],
        )
        step += 1
        if stop:
            break
        progress.update(step, numbers, dt)
        if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
            a.save(checkpoint.LAST, step, a.hist)
        if stopper.agreed(a.accelerator):
            break
    return step


def _train_arm(cfg: Config, arm: str, data: TaskData):
    """One arm to ``cfg.train.steps`` (or divergence / a stop signal): (summary, accelerator,
    whether a signal stopped it). ``cfg`` is the arm's own (``Config.arm_config``)."""
    from accelerate import PartialState

    cuda = torch.cuda.is_available()
    build.apply_determinism(cfg)  # before the arm's first matmul
    state = PartialState(cpu=not cuda)
    plan, backend, config = _start(cfg, arm, data, state)
    d = runs.arm_dir(cfg, arm)
    accelerator = build.make_accelerator(cfg, d, plan.step if plan.kind == "resume" else None)
    if plan.kind == "done":
        s = plan.summary
        accelerator.print(
            f"[{arm}] finished: {s.get('status')} after {s.get('steps')} steps "
            f"({d / 'summary.json'}); nothing to do (--fresh=True starts over)"
        )
        return plan.summary, accelerator, False
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # per arm (the previous arm's state is freed)
    a = _build_arm(cfg, arm, data, accelerator, plan, backend, config)
    start_trackers(accelerator, cfg.name, arm, d, config)
    workers = cfg.num_workers if cfg.num_workers is not None else (2 if cuda else 0)
    loader = step_loader(
        data.make_micro,
        cfg,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        start=a.start,
        num_workers=workers,
        pin_memory=cuda,
    )
    a.wall_base, a.wall_start = a.hist.wall_time_s, time.time()
    progress = Progress(a)
    with Stopper() as stopper:
        step = _loop(a, loader, stopper, progress)
        interrupted = stopper.agreed(accelerator)  # one answer for every process
    progress.close()
    return _finish(a, step, interrupted), accelerator, interrupted


def _finish(a: Arm, step: int, interrupted: bool) -> dict:
    """Last checkpoint, trackers closed, summary written; the arm's memory released."""
    cfg, accelerator = a.cfg, a.accelerator
    a.tick(a.hist)
    if a.policy.divergence is None or cfg.train.on_divergence == "continue":
        a.save(checkpoint.LAST, step, a.hist)
    end_trackers(accelerator)
    status = a.policy.status
    if interrupted and status == "stable":
        status = "interrupted"
    cuda = accelerator.device.type == "cuda"
    summary = runs.arm_summary(
        arm=a.name,
        backend=a.backend,
        status=status,
        divergence=a.policy.divergence,
        hist=a.hist,
        steps=step,
        interrupted=interrupted,
        params=a.n_params,
        init_hash=a.init_hash,
        peak_lr=cfg.train.peak_lr,
        log_logits=bool(cfg.telemetry.logit_every),
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    )
    if cfg.model.gates:
        summary.update(runs.dead_gates(a.hist.gate_mean_L, cfg.telemetry.dead_gate_below))
        if summary["dead_gate_layers"]:
            a.say(
                f"dead gate layers {summary['dead_gate_layers']}: mean gate < "
                f"{cfg.telemetry.dead_gate_below:g} at the last logged step"
            )
    if accelerator.is_main_process:
        runs.write_summary(a.dir, **summary)
        fast = a.trainee.fast
        runs.add_provenance(
            a.dir,
            autotune=autotune_choices(),
            fast_path=None if fast is None else {"mode": fast.mode, "note": fast.note},
            sdpa_kernels=_sdpa_kernels(a) if a.backend == "softmax" else None,
            sharded="FSDP2" if sharding.is_sharded(a.trainee.model) else None,
        )
    accelerator.wait_for_everyone()
    # Accelerate keeps every prepared model and optimizer; drop this arm's so that the next arm
    # (same process) neither carries its memory nor counts it in its own peak.
    accelerator.free_memory()
    return summary


def _sdpa_kernels(a: Arm) -> dict[str, str]:
    """The SDPA kernels an arm on the ``softmax`` backend ran at its micro-batch shape, in the
    dtype autocast gave them (``attention.sdpa_kernels``)."""
    cfg, m = a.cfg, a.cfg.model
    bf16 = a.accelerator.mixed_precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    return sdpa_kernels(
        cfg.train.micro_batch, m.n_heads, cfg.data.context_len, m.head_dim, dtype,
        a.accelerator.device, causal=cfg.task == "lm",
        key_bias=m.gates and m.gate_injection != "values",
    )  # fmt: skip


def train_arm(cfg: Config, arm: str, data: TaskData | None = None) -> dict:
    """Train one arm (or cell) of ``cfg``; returns its summary."""
    with runs.hold([runs.arm_dir(cfg, arm)]):
        data = data if data is not None else open_data(cfg)
        summary, accelerator, _ = _train_arm(cfg.arm_config(arm), arm, data)
    return summary


def run(cfg: Config) -> dict[str, dict]:
    """Every arm of ``cfg`` in turn, then (main process) the analysis report over them; the arm
    dirs locked for the whole run (``runs.hold``: another process on one of them is refused)."""
    from accelerate import PartialState

    cuda = torch.cuda.is_available()
    check(cfg, PartialState(cpu=not cuda).num_processes, cuda)
    with runs.hold([runs.arm_dir(cfg, a) for a in cfg.arms()]):  # before a file is written
        return _run(cfg)


def _run(cfg: Config) -> dict[str, dict]:
    data = open_data(cfg)
    warmstart.check_vocab(cfg, data.vocab_size)
    summaries = {}
    for arm in cfg.arms():
        summaries[arm], accelerator, stopped = _train_arm(cfg.arm_config(arm), arm, data)
        if stopped:
            break
    if accelerator.is_main_process:
        runs.print_summaries(summaries)
        logs = Path(cfg.out_dir) / cfg.name
        print(f"tensorboard logs: {logs}  (tensorboard --logdir {logs})")
        if cfg.report:
            from stabilitylab.analysis.report import write_report

            paths = write_report([runs.arm_dir(cfg, a) for a in summaries], logs / "report")
            print(f"report: {paths.get('report.md', paths)}")
    accelerator.end_training()  # the arms closed their trackers; this ends the process group
    return summaries
