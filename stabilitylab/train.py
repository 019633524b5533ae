"""The training loop on HF accelerate: paired arms, accumulation, telemetry, divergence policy,
checkpoint and resume.

    result = run(cfg)            # every arm of cfg, one after the other, then the report

Each arm starts from the same initial weights (seeded construction, checked by hash) and sees the
same data in the same order: global sample ``step * global_batch + j`` is the same cell and the same
mask whatever the number of processes. The loss is the mean over every masked token of the global
batch, so one process and N processes at the same global batch follow the same curve.
"""

from __future__ import annotations

import hashlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from stabilitylab import runs, tags
from stabilitylab.config import Config, ConfigError
from stabilitylab.data import build_source, make_batch
from stabilitylab.kernels import autotune_choices
from stabilitylab.model import (
    Encoder,
    count_parameters,
    flops_per_step,
    masked_lm_loss_sum,
    vocab_size_for,
)
from stabilitylab.telemetry import (
    LayerStatsMonitor,
    LogitMonitor,
    Writer,
    first_nonfinite_module,
    global_grad_norm,
)

# Dense bf16 peak (TFLOPS) by GPU name fragment, for MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}
MAX_CONSECUTIVE_NONFINITE = 20


def make_accelerator(cfg: Config):
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    return Accelerator(
        cpu=not cuda,
        mixed_precision="bf16" if precision == "bf16" else "no",
        step_scheduler_with_optimizer=False,
    )


def accumulation_steps(cfg: Config, world: int) -> int:
    per_step = cfg.train.micro_batch * world
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"config train.global_batch: {cfg.train.global_batch} is not a multiple of "
            f"train.micro_batch ({cfg.train.micro_batch}) x processes ({world})"
        )
    return cfg.train.global_batch // per_step


def build_model(cfg: Config, backend: str, vocab: int) -> Encoder:
    torch.manual_seed(cfg.train.seed)
    return Encoder(cfg.model, vocab, cfg.data.context_len, backend)


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def lr_at(cfg: Config, step: int) -> float:
    """Linear warmup to the peak lr over ``warmup_steps``, then constant (the paper's schedule)."""
    peak = cfg.train.peak_lr
    w = cfg.train.warmup_steps
    return peak * min(1.0, (step + 1) / w) if w > 0 else peak


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    # Weight decay on matrices and embeddings only; biases and LayerNorm gains are not decayed.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    t = cfg.train
    # fused: one kernel per step, and it honours ``found_inf`` (the update is skipped on the
    # device when a gradient is not finite; see train_arm).
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(cfg, 0),
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        fused=True,
    )


@dataclass
class History:
    """Per-step loss and global grad norm: what the online divergence policy reads."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    max_logit: float = 0.0
    nonfinite_steps: list[int] = field(default_factory=list)


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

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: Path, accelerator, model, optimizer, step: int, hist: History, extra=None
):
    """Model/optimizer from the main process; each rank's RNG state beside it."""
    rank = accelerator.process_index
    rng_path = path.with_name(f"{path.stem}.rng{rank}.pt")
    torch.save(_rng_state(), rng_path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "history": hist.__dict__,
                "world_size": accelerator.num_processes,
                **(extra or {}),
            },
            tmp,
        )
        tmp.replace(path)
    accelerator.wait_for_everyone()


def load_checkpoint(path: Path, accelerator, model, optimizer) -> tuple[int, History]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    accelerator.unwrap_model(model).load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    rng_path = path.with_name(f"{path.stem}.rng{accelerator.process_index}.pt")
    if rng_path.exists() and ckpt.get("world_size") == accelerator.num_processes:
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return ckpt["step"], History(**ckpt["history"])


def _check_online(hist: History):
    from stabilitylab.analysis.detectors import diverged

    return diverged(
        np.asarray(hist.steps),
        np.asarray(hist.loss),
        np.asarray(hist.steps),
        np.asarray(hist.grad_norm),
    )


def train_arm(cfg: Config, arm: str, accelerator, source=None) -> dict:
    """Train one arm to ``cfg.train.steps`` (or divergence / a stop signal); returns its summary."""
    cuda = accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # per arm (the previous arm's state is freed)
    backend = cfg.backend_for(arm, cuda)
    world, rank = accelerator.num_processes, accelerator.process_index
    accum = accumulation_steps(cfg, world)
    main = accelerator.is_main_process
    d = runs.arm_dir(cfg, arm)
    if main:
        runs.start_arm(cfg, arm, backend)
    accelerator.wait_for_everyone()

    source = source if source is not None else build_source(cfg.data, cfg.train.seed)
    vocab = vocab_size_for(source.n_genes)
    model = build_model(cfg, backend, vocab)
    init_hash = weights_hash(model)
    n_params = count_parameters(model)
    n_dense = n_params - model.tok_emb.weight.numel() - model.pos_emb.weight.numel()
    if main:
        accelerator.print(
            f"[{arm}] backend={backend} params={n_params / 1e6:.1f}M init_hash={init_hash} "
            f"processes={world} accumulation={accum} micro_batch={cfg.train.micro_batch}"
        )
    optimizer = make_optimizer(cfg, model)
    if cfg.train.compile:
        model.compile()  # in place: DDP wraps it as usual and the hooks see the same modules
    model, optimizer = accelerator.prepare(model, optimizer)
    raw = accelerator.unwrap_model(model)
    params = list(raw.parameters())
    inner_opt = getattr(optimizer, "optimizer", optimizer)  # under accelerate's wrapper

    start, hist = 0, History()
    last = d / "checkpoints" / "last.pt"
    if cfg.resume and last.exists():
        start, hist = load_checkpoint(last, accelerator, model, optimizer)
        if main:
            accelerator.print(f"[{arm}] resumed from {last} at step {start}")

    writer = Writer(d if main else None, cfg.telemetry.flush_secs)
    layer_mon = LayerStatsMonitor(cfg.telemetry.layer_every)
    logit_mon = LogitMonitor(cfg.telemetry.logit_every)
    probe = None
    if cfg.telemetry.probe_every > 0:
        from stabilitylab.probes.live import JacobianProbe

        t = cfg.telemetry
        probe = JacobianProbe(
            t.probe_every, t.probe_samples, t.probe_tokens, t.probe_iters, seed=cfg.train.seed
        )
    peak = cfg.train.peak_tflops
    if peak is None and cuda:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

    status, div = "stable", None
    consecutive_nonfinite, t0_run = 0, time.time()
    per_rank = cfg.train.global_batch // world
    step = start
    pbar = None
    if main:
        from tqdm.auto import tqdm

        pbar = tqdm(
            total=cfg.train.steps, initial=start, desc=arm, dynamic_ncols=True, mininterval=2.0
        )

    with Stopper() as stopper:
        while step < cfg.train.steps:
            t0 = time.perf_counter()
            layer_stats = None
            base = step * cfg.train.global_batch + rank * per_rank
            micro_cpu = [
                make_batch(
                    source,
                    range(base + i * cfg.train.micro_batch, base + (i + 1) * cfg.train.micro_batch),
                    context_len=cfg.data.context_len,
                    mask_prob=cfg.data.mask_prob,
                    seed=cfg.train.seed,
                )
                for i in range(accum)
            ]
            # Masked-token and valid-token counts of the whole global batch stay on the device:
            # the loss scale needs them, the host only reads them with the step's other numbers.
            counts = torch.tensor(
                [
                    sum(b.n_masked for b in micro_cpu),
                    sum(int(b.lengths_B.sum()) for b in micro_cpu),
                ],
                dtype=torch.float32,
            ).to(accelerator.device)
            if world > 1:
                counts = accelerator.reduce(counts, reduction="sum")
            n_masked = counts[0]
            micro = [b.to(accelerator.device) for b in micro_cpu]
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, step)

            log_logits = logit_mon.due(step)
            if log_logits:
                logit_mon.attach(raw)
            loss_sum = torch.zeros((), device=accelerator.device)
            for i, b in enumerate(micro):
                sync = accelerator.no_sync(model) if i < accum - 1 else _null()
                with sync:
                    logits_BTV = model(b.tokens_BT, b.lengths_B)
                    part = masked_lm_loss_sum(logits_BTV, b.labels_BT)
                    # DDP averages gradients over processes; scale so the result is the global mean.
                    accelerator.backward(part * (world / n_masked))
                loss_sum += part.detach()
                if log_logits:
                    logit_mon.collect(raw)
            max_LH = logit_mon.detach(raw) if log_logits else None

            gn = global_grad_norm(params)
            loss = accelerator.reduce(loss_sum, reduction="sum") / n_masked
            loss_gn = torch.stack([loss.float(), gn.float().to(loss.device), counts[1]])
            # The update is skipped on the device when the loss or a gradient is not finite
            # (AdamW's found_inf, as GradScaler uses it), so the host reads the numbers once, after
            # the update is queued, instead of stalling the queue before it.
            inner_opt.found_inf = (~torch.isfinite(loss_gn[:2]).all()).float().to(gn.device)
            if cfg.train.clip_grad is not None:  # reuses the norm above; no second pass
                torch.nn.utils.clip_grads_with_norm_(params, cfg.train.clip_grad, gn)
            measure_layers = layer_mon.due(step)
            if measure_layers:
                layer_mon.before_step(raw)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_f, gn_f, n_tokens = loss_gn.tolist()
            finite = math.isfinite(loss_f) and math.isfinite(gn_f)
            if finite:
                consecutive_nonfinite = 0
                layer_stats = layer_mon.after_step(raw) if measure_layers else None
            else:  # the weights and optimizer state are those before this step
                consecutive_nonfinite += 1
                hist.nonfinite_steps.append(step)
                if div is None:
                    status = "diverged"
                    bad = first_nonfinite_module(
                        raw, lambda b=micro[0]: raw(b.tokens_BT, b.lengths_B)
                    )
                    div = {
                        "step": step,
                        "reason": f"non-finite {'loss' if not math.isfinite(loss_f) else 'gradient'}",
                        "module": bad or ("backward" if math.isfinite(loss_f) else None),
                    }
                    save_checkpoint(
                        d / "checkpoints" / f"forensic_step{step}.pt",
                        accelerator,
                        model,
                        optimizer,
                        step,
                        hist,
                        {"batch_indices": [base, per_rank], "divergence": div},
                    )
                    if main:
                        accelerator.print(
                            f"[{arm}] step {step}: {div['reason']} (first module: {div['module']})"
                        )
                        writer.scalars({tags.NONFINITE: 1.0}, step)
                if (
                    cfg.train.on_divergence == "stop"
                    or consecutive_nonfinite >= MAX_CONSECUTIVE_NONFINITE
                ):
                    hist.steps.append(step)
                    hist.loss.append(loss_f)
                    hist.grad_norm.append(gn_f)
                    step += 1
                    break

            hist.steps.append(step)
            hist.loss.append(loss_f)
            hist.grad_norm.append(gn_f)
            dt = time.perf_counter() - t0
            scalars = {}
            if cfg.telemetry.log_every and step % cfg.telemetry.log_every == 0:
                scalars.update(
                    {
                        tags.LOSS: loss_f,
                        tags.LR: lr_at(cfg, step),
                        tags.GRAD_NORM: gn_f,
                        tags.STEP_TIME: dt,
                        tags.TOKENS_PER_S: n_tokens / dt,
                    }
                )
                if peak:
                    lengths = [int(x) for b in micro_cpu for x in b.lengths_B.tolist()]
                    flops = flops_per_step(cfg.model, n_dense, lengths) * world
                    scalars[tags.MFU] = flops / dt / (peak * 1e12 * world)
                if cuda:  # the allocator's own counter: no device sync
                    scalars[tags.PEAK_MEM] = torch.cuda.max_memory_allocated() / 2**30
            if finite and layer_stats is not None:
                scalars.update(LayerStatsMonitor.to_scalars(layer_stats.tolist()))
            if max_LH is not None:
                if world > 1:
                    torch.distributed.all_reduce(max_LH, op=torch.distributed.ReduceOp.MAX)
                logit_scalars = LogitMonitor.to_scalars(max_LH.tolist())
                hist.max_logit = max(hist.max_logit, logit_scalars[tags.MAX_LOGIT])
                scalars.update(logit_scalars)
            if probe is not None and probe.due(step) and main:
                sigmas = probe.measure(raw, micro[0].tokens_BT, micro[0].lengths_B)
                scalars.update({tags.layer(tags.JACOBIAN_LAYER, i): s for i, s in sigmas.items()})
            writer.scalars(scalars, step)

            if (
                finite
                and div is None
                and cfg.telemetry.log_every
                and step % cfg.telemetry.log_every == 0
            ):
                det = _check_online(hist)
                if det is not None:
                    status = "diverged"
                    div = {
                        "step": int(det.step),
                        "reason": f"{det.detector}: {det.detail}",
                        "module": None,
                    }
                    save_checkpoint(
                        d / "checkpoints" / f"forensic_step{step}.pt",
                        accelerator,
                        model,
                        optimizer,
                        step + 1,
                        hist,
                        {"divergence": div},
                    )
                    if main:
                        accelerator.print(f"[{arm}] diverged at step {det.step}: {div['reason']}")
                    if cfg.train.on_divergence == "stop":
                        step += 1
                        break
            step += 1
            if pbar is not None:
                pbar.update(1)
                if step % 10 == 0:
                    pbar.set_postfix(
                        loss=f"{loss_f:.3f}", gn=f"{gn_f:.2g}", tok_s=f"{n_tokens / dt:.3g}"
                    )
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                save_checkpoint(last, accelerator, model, optimizer, step, hist)
            if stopper.requested:
                status = "interrupted" if status == "stable" else status
                break

    stopped_by_signal = stopper.requested
    if div is None or cfg.train.on_divergence == "continue":
        save_checkpoint(last, accelerator, model, optimizer, step, hist)
    if pbar is not None:
        pbar.close()
    writer.flush()
    writer.close()
    finite_gn = [g for g in hist.grad_norm if math.isfinite(g)]
    finite_loss = [x for x in hist.loss if math.isfinite(x)]
    summary = {
        "arm": arm,
        "backend": backend,
        "status": status,
        "divergence_step": None if div is None else div["step"],
        "divergence_reason": None if div is None else div["reason"],
        "first_nonfinite_module": None if div is None else div["module"],
        "nonfinite_steps": len(hist.nonfinite_steps),
        "max_grad_norm": max(finite_gn) if finite_gn else None,
        "max_logit": hist.max_logit if cfg.telemetry.logit_every else None,
        "steps": step,
        "wall_time_s": time.time() - t0_run,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "initial_loss": hist.loss[0] if hist.loss else None,
        "final_loss": finite_loss[-1] if finite_loss else None,
        "params": n_params,
        "init_hash": init_hash,
        "peak_lr": cfg.train.peak_lr,
        "interrupted_by_signal": stopped_by_signal,
    }
    if main:
        runs.write_summary(d, **summary)
        runs.add_provenance(d, autotune=autotune_choices())
    accelerator.wait_for_everyone()
    # Accelerate keeps every prepared model and optimizer; drop this arm's so that the next arm
    # (same process) neither carries its memory nor counts it in its own peak.
    accelerator.free_memory()
    return summary


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run(cfg: Config) -> dict[str, dict]:
    """Every arm of ``cfg`` in turn, then (main process) the analysis report over them."""
    accelerator = make_accelerator(cfg)
    source = build_source(cfg.data, cfg.train.seed)
    summaries = {}
    for arm in cfg.arms():
        summaries[arm] = train_arm(cfg, arm, accelerator, source)
        if summaries[arm].get("interrupted_by_signal"):
            break
    if accelerator.is_main_process:
        print_summaries(summaries)
        print(
            f"tensorboard logs: {Path(cfg.out_dir) / cfg.name}  (tensorboard --logdir {Path(cfg.out_dir) / cfg.name})"
        )
        if cfg.report:
            from stabilitylab.analysis.report import write_report

            paths = write_report(
                [runs.arm_dir(cfg, a) for a in summaries], Path(cfg.out_dir) / cfg.name / "report"
            )
            print(f"report: {paths.get('report.md', paths)}")
    accelerator.end_training()
    return summaries


def print_summaries(summaries: dict[str, dict]) -> None:
    cols = [
        "status",
        "divergence_step",
        "steps",
        "initial_loss",
        "final_loss",
        "max_grad_norm",
        "max_logit",
        "wall_time_s",
    ]
    print("\narm      " + " ".join(f"{c:>15}" for c in cols))
    for arm, s in summaries.items():
        cells = []
        for c in cols:
            v = s.get(c)
            cells.append(f"{v:>15.4g}" if isinstance(v, float) else f"{v!s:>15}")
        print(f"{arm:<8} " + " ".join(cells))
