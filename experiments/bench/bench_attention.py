"""Attention benchmark on one GPU: the Triton sigmoid op vs SDPA cuDNN / flash, FlexAttention, eager.

    python experiments/bench/bench_attention.py --quick --out runs/bench   # T 4K/16K, 0/25% padding
    python experiments/bench/bench_attention.py --out runs/bench           # the full grid
    python experiments/bench/bench_attention.py --model-step --out runs/bench

Prints the fast sigmoid's accuracy against float64, one line of TFLOPS per provider, shape and
round, then the table and the kernel bars. Grid: bf16, head dim 64/128, T = 1K..16K, 16,384 tokens
per batch (B = 16384 / T), hidden 2048 (H = 2048 / D), padding 0/25/50% (every sequence has
L = (1 - p) T valid tokens). TFLOPS count valid tokens only: forward 4 H D sum(L^2), backward 2.5x
forward; time = do_bench median (ms). ``sigmoid-triton`` is the op as the model calls it,
``sigmoid-triton-exact`` its exact sigmoid mode, ``softmax-triton`` the softmax kernel on the same
skeleton (padding by lengths, as the sigmoid op). On request, ``sigmoid-triton-det``,
``softmax-triton-det`` and ``flash-det``: that provider under
``torch.use_deterministic_algorithms``, as ``train.deterministic`` runs it (pinned Triton configs,
flash's deterministic backward), the mode on for its own calls only. Softmax baselines get a
key-padding mask where they support one (cuDNN: boolean mask; flash: none, so padded rows are
skipped; FlexAttention: a block mask that skips padded blocks). Expected on an H200
(docs/BENCHMARKS.md): cuDNN ~445 fwd TFLOPS at hd64, ~600 at hd128.

    # the deterministic paths against cuDNN and flash in one run (a few minutes on an H200):
    python experiments/bench/bench_attention.py --seq-lens 4096 8192 --paddings 0 \
        --providers softmax-triton softmax-triton-det cudnn flash flash-det sigmoid-triton \
        sigmoid-triton-det --out runs/bench_det

``--model-step``: the stress_8k Transformer (12 x 768, hd 64) at T=8192, bf16 autocast, forward +
masked-LM loss + backward, ``softmax`` vs ``sigmoid-triton`` backends, micro-batch 1 and 2,
alternating for ``--rounds``.
Writes ``attention.csv`` / ``attention.md`` and the bars read from them, ``bars.csv`` / ``bars.md``
(``stabilitylab.analysis.bench_report``), or ``model_step.csv`` / ``model_step.md``, under
``--out``. Every shape is timed ``--rounds`` times (default 3), providers interleaved within a
round; tables show medians over rounds, bars medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from stabilitylab.analysis.bench_report import (
    bars,
    bars_markdown,
    markdown_table,
    model_step_bar,
    summary,
)
from stabilitylab.determinism import deterministic_mode, set_cublas_workspace
from stabilitylab.kernels import sigmoid_attention, softmax_attention
from stabilitylab.kernels.reference import key_mask_BT, sigmoid_attention_reference
from stabilitylab.kernels.sigmoid_attention import EXACT, TANH_F32, _fwd_op

TOKENS, HIDDEN = 16_384, 2048
PROVIDERS = ["sigmoid-triton", "sigmoid-triton-exact", "softmax-triton", "cudnn", "flash", "flex",
             "eager-sigmoid"]  # fmt: skip
DETERMINISTIC_PROVIDERS = ["sigmoid-triton-det", "softmax-triton-det", "flash-det"]
KNOWN_PROVIDERS = PROVIDERS + DETERMINISTIC_PROVIDERS  # the default runs PROVIDERS
DETERMINISTIC_SUFFIX = "-det"
"""``<provider>-det``: the provider timed under ``torch.use_deterministic_algorithms(True)``, as
train.deterministic runs it (the Triton kernels launch their one pinned config; flash takes its
deterministic backward; new tensors are filled, as in training)."""


def flops_fwd(H: int, D: int, lengths: list[int]) -> float:
    return 4.0 * H * D * sum(L * L for L in lengths)


def make_inputs(T: int, D: int, pad: float, device="cuda"):
    B, H = TOKENS // T, HIDDEN // D
    L = int(round(T * (1 - pad)))
    lengths_B = torch.full((B,), L, dtype=torch.int32, device=device)
    q, k, v = (
        torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    return q, k, v, lengths_B


def is_deterministic(name: str) -> bool:
    return name.endswith(DETERMINISTIC_SUFFIX)


def provider_fn(name: str, q, k, v, lengths_B) -> Callable[[], torch.Tensor] | None:
    """A zero-argument forward for ``name`` on these inputs, or None when it does not apply. A
    ``-det`` provider's forward is its base provider's; ``time_provider`` sets the mode."""
    if is_deterministic(name):
        return provider_fn(name.removesuffix(DETERMINISTIC_SUFFIX), q, k, v, lengths_B)
    B, H, T, D = q.shape
    padded = bool((lengths_B < T).any())
    valid_BT = key_mask_BT(lengths_B, T)
    if name == "sigmoid-triton":
        return lambda: sigmoid_attention(q, k, v, lengths_B)[0]
    if name == "sigmoid-triton-exact":
        return lambda: sigmoid_attention(q, k, v, lengths_B, exact=True)[0]
    if name == "softmax-triton":
        return lambda: softmax_attention(q, k, v, lengths_B)[0]
    if name == "cudnn":
        mask = valid_BT[:, None, None, :] if padded else None

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return run
    if name == "flash":
        if padded:
            return None  # flash takes no mask; varlen is not exposed through SDPA

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        return run
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # A fresh dynamo cache per shape: past the recompile limit dynamo silently runs the unfused
        # eager flex_attention (a suspected cause of ~15 TFLOPS at hd128, T >= 8K on 2026-11-29).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        L_B = lengths_B

        def valid(b, h, q_idx, kv_idx):
            return (q_idx < L_B[b]) & (kv_idx < L_B[b])

        block_mask = create_block_mask(valid, B, None, T, T, device=q.device)
        return lambda: flex(q, k, v, block_mask=block_mask)
    if name == "eager-sigmoid":
        if B * H * T * T > 2**32:
            return None  # the n x n scores and their grads would not fit comfortably
        return lambda: sigmoid_attention_reference(q, k, v, lengths_B)
    raise ValueError(f"unknown provider {name!r}; choose from {KNOWN_PROVIDERS}")


def time_provider(name, fwd, q, k, v) -> tuple[float, float]:
    """do_bench medians (ms) of ``fwd`` and of its backward; NaN where ``fwd`` is None. A ``-det``
    provider is run, warm-up and timings, under ``deterministic_mode``, and only it."""
    if fwd is None:
        return float("nan"), float("nan")
    with deterministic_mode(is_deterministic(name)):
        return _time_fwd_bwd(fwd, q, k, v)


def _time_fwd_bwd(fwd, q, k, v) -> tuple[float, float]:
    out = fwd()  # compile / autotune outside the timed region
    ms_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    g = torch.randn_like(out)
    grad = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    grad()
    ms_b = triton.testing.do_bench(grad, warmup=25, rep=100, return_mode="median")
    return ms_f, ms_b


def accuracy_check() -> list[dict]:
    """Max abs error vs float64 of each sigmoid mode and of eager bf16, on one small shape."""
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 1024, 128
    q, k, v = (torch.randn(B, H, T, D, device="cuda") for _ in range(3))
    lengths_B = torch.tensor([1024, 700], device="cuda")
    ref = sigmoid_attention_reference(q.double(), k.double(), v.double(), lengths_B)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    rows = [
        {
            "mode": "eager bf16",
            "max_abs_err": (sigmoid_attention_reference(qb, kb, vb, lengths_B).double() - ref)
            .abs()
            .max()
            .item(),
        }
    ]
    for name, mode in (("exact", EXACT), ("tanh.f32", TANH_F32)):
        out = _fwd_op(qb, kb, vb, lengths_B, 1 / math.sqrt(D), 0.0, True, mode, False)[0]
        rows.append({"mode": name, "max_abs_err": (out.double() - ref).abs().max().item()})
    return rows


def _report_failure(name, D, T, pad, e: Exception) -> None:
    print(f"  {name} D={D} T={T} pad={pad}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def bench_attention(args) -> pd.DataFrame:
    """Shapes outermost, then rounds, then providers: within a round every provider runs on the
    same inputs one after another, so per-round ratios compare kernels under the same conditions
    (the H200 runs at its power cap; see docs/BENCHMARKS.md). One CSV row is appended per
    measurement, so a run cut off keeps its rows."""
    rows, csv = [], os.path.join(args.out, "attention.csv")
    if os.path.exists(csv):
        os.remove(csv)
    for D in args.head_dims:
        for T in args.seq_lens:
            for pad in args.paddings:
                q, k, v, lengths_B = make_inputs(T, D, pad)
                B, H = q.shape[:2]
                fl = flops_fwd(H, D, lengths_B.tolist())
                fns = {}
                for name in args.providers:
                    try:  # flex compiles here, once per shape
                        fns[name] = provider_fn(name, q, k, v, lengths_B)
                    except Exception as e:  # a baseline that cannot run a shape is a row
                        _report_failure(name, D, T, pad, e)
                        fns[name] = None
                for rnd in range(args.rounds):
                    for name in args.providers:
                        try:
                            ms_f, ms_b = time_provider(name, fns[name], q, k, v)
                        except Exception as e:
                            _report_failure(name, D, T, pad, e)
                            ms_f = ms_b = float("nan")
                        row = {
                            "provider": name, "D": D, "T": T, "B": B, "H": H, "pad": pad,
                            "round": rnd, "fwd_ms": ms_f, "bwd_ms": ms_b,
                            "fwd_tflops": fl / ms_f * 1e-9, "bwd_tflops": 2.5 * fl / ms_b * 1e-9,
                        }  # fmt: skip
                        rows.append(row)
                        header = len(rows) == 1
                        pd.DataFrame([row]).to_csv(csv, mode="a", header=header, index=False)
                        print(
                            f"{name:22s} D={D:3d} T={T:5d} pad={pad:.2f} round {rnd} fwd"
                            f" {row['fwd_tflops']:6.1f} bwd {row['bwd_tflops']:6.1f} TFLOPS",
                            flush=True,
                        )
                del q, k, v, fns
                torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def _time_step(model, tokens, lengths, labels, loss_fn) -> float:
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, lengths)
        loss_fn(logits, labels).backward()

    step()
    return triton.testing.do_bench(step, warmup=300, rep=1500, return_mode="median")


def bench_model_step(args) -> pd.DataFrame:
    """Both backends built once per micro-batch, then timed alternately for ``args.rounds``."""
    from stabilitylab.config import stress_8k
    from stabilitylab.model import Transformer, masked_lm_loss_sum, vocab_size_for

    cfg = stress_8k()
    T, vocab = 8192, vocab_size_for(cfg.data.n_genes)
    rows = []
    for mb in (1, 2):
        models = {}
        for backend in ("softmax", "sigmoid-triton"):
            torch.manual_seed(0)
            models[backend] = Transformer(cfg.model, vocab, T, backend).cuda()
        tokens = torch.randint(3, vocab, (mb, T), device="cuda")
        lengths = torch.full((mb,), T, device="cuda")
        labels = torch.where(torch.rand(mb, T, device="cuda") < 0.15, tokens, -100)
        for rnd in range(args.rounds):
            for backend, model in models.items():
                ms = _time_step(model, tokens, lengths, labels, masked_lm_loss_sum)
                rows.append(
                    {"backend": backend, "micro_batch": mb, "T": T, "round": rnd, "step_ms": ms}
                )
                print(f"model step {backend:15s} mb={mb} round {rnd}: {ms:.1f} ms", flush=True)
        del models
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def provenance() -> str:
    return (
        f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {triton.__version__} | CUDA {torch.version.cuda} | python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="T 4K/16K, padding 0/25%% (a few minutes on an H200)"
    )
    p.add_argument(
        "--model-step", action="store_true", help="time the stress_8k Transformer step instead"
    )
    p.add_argument(
        "--providers", nargs="+", default=PROVIDERS,
        help=f"default {' '.join(PROVIDERS)}; also {' '.join(DETERMINISTIC_PROVIDERS)}",
    )  # fmt: skip
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, help="override the T grid")
    p.add_argument("--paddings", nargs="+", type=float, help="override the padding grid")
    p.add_argument(
        "--rounds", type=int, default=3,
        help="times each shape is timed for every provider (interleaved); tables show medians",
    )  # fmt: skip
    p.add_argument("--out", default="runs/bench", help="folder for the CSV and markdown tables")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    unknown = [name for name in args.providers if name not in KNOWN_PROVIDERS]
    if unknown:
        p.error(f"unknown providers {unknown}; choose from {KNOWN_PROVIDERS}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    if any(map(is_deterministic, args.providers)):  # as train.deterministic: before any matmul
        set_cublas_workspace()
    os.makedirs(args.out, exist_ok=True)
    print(provenance())
    if args.model_step:
        df, name = bench_model_step(args), "model_step"
    else:
        quick_T, full_T = [4096, 16384], [1024, 2048, 4096, 8192, 16384]
        args.seq_lens = args.seq_lens or (quick_T if args.quick else full_T)
        args.paddings = args.paddings or ([0.0, 0.25] if args.quick else [0.0, 0.25, 0.5])
        for row in accuracy_check():
            print(f"accuracy {row['mode']:12s} max abs err vs fp64 {row['max_abs_err']:.2e}")
        df, name = bench_attention(args), "attention"
    if args.model_step:
        df.to_csv(os.path.join(args.out, f"{name}.csv"), index=False)
        table = markdown_table(model_step_bar(df))
    else:
        table = markdown_table(summary(df))
        bar_table = bars(df)
        bar_table.to_csv(os.path.join(args.out, "bars.csv"), index=False)
        with open(os.path.join(args.out, "bars.md"), "w") as f:
            f.write(f"{provenance()}, {args.rounds} rounds\n\n{bars_markdown(bar_table)}\n")
        print(bars_markdown(bar_table))
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(f"{provenance()}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
