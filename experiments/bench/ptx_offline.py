"""Offline sm_90a PTX of the sigmoid attention kernels as the op launches them (no GPU needed).

    python experiments/bench/ptx_offline.py --out /tmp/ptx_new            # ~1 min, 114 files
    git worktree add /tmp/old <commit>  # or any other checkout
    PYTHONPATH=/tmp/old python experiments/bench/ptx_offline.py --out /tmp/ptx_old
    diff -r /tmp/ptx_old /tmp/ptx_new   # a change that keeps the kernels prints nothing

Runs ``forward_auto`` / ``backward_auto`` on CPU tensors with the capability set to sm_90 and
the launcher replaced by a recorder, at head dim 64 and 128, T = 2048 and 4096 (pointer and TMA
loads), padded and unpadded (the dense kernels), both sigmoid modes, the forward with and without
the max; then compiles every recorded launch for every production config (``_configs``) up to
Triton's PTX stage, line info off. A file is named by kernel and a hash of what selects its code
(specialisation, constexprs, descriptor blocks, warps, stages), so two checkouts' files pair up.
``--gated``: also causal and key-bias variants (a checkout that has them), and the fused gate's
(causal, ``gated``) where the checkout has it. Spills and registers:
``ptxas -arch=sm_90a -v FILE.ptx`` with the ptxas that Triton's wheel ships. Uses Triton's
private launch-binding helpers: checked with triton 3.6 and 3.9.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import os

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # before triton is imported: PTX without .loc lines
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Arguments added with the causal mask and key bias: named apart so that a variant without them
# hashes as it did before they existed.
GATED_ARGS = ("CAUSAL", "HAS_KEY_BIAS", "KB", "skbb", "skbh", "DKB", "HAS_GATE")


def record_launches(gated: bool, head_dims=(64, 128), seq_lens=(2048, 4096)) -> tuple[object, list]:
    """The op's module and the launches it makes: (kernel, kind, fp32, args, kwargs, dense)."""
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
    ts = importlib.import_module("stabilitylab.kernels.triton_support")
    launches = []
    saved = (sa._launch, sa.capability, ts.capability)
    sa.capability = ts.capability = lambda device: (9, 0)
    sa._launch = lambda kernel, kind, q, grid, args, kwargs, dense=False: launches.append(
        (kernel, kind, q.dtype == torch.float32, args, dict(kwargs), dense)
    )
    try:
        _run_the_op(sa, gated, head_dims, seq_lens)
    finally:
        sa._launch, sa.capability, ts.capability = saved
    return sa, launches


def _run_the_op(sa, gated: bool, head_dims, seq_lens) -> None:
    """The op's forward and backward over the variants of the module docstring."""
    gen = torch.Generator().manual_seed(0)
    for D in head_dims:
        for T in seq_lens:
            for full in (False, True):
                qkv = torch.randn(2, T, 3, 16, D, generator=gen).to(torch.bfloat16)
                q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # the model's packed views
                do = torch.randn(2, 16, T, D, generator=gen).to(torch.bfloat16)
                lengths = torch.tensor([T, T] if full else [T, T * 7 // 8 + 1], dtype=torch.int32)
                bias = torch.zeros(2, T)[:, None, :].expand(2, 16, T)
                tails = [{}]
                if gated:
                    tails += [{"causal": True}, {"key_bias": bias},
                              {"causal": True, "key_bias": bias}]  # fmt: skip
                if gated and "gated" in inspect.signature(sa.forward_auto).parameters:
                    tails.append({"causal": True, "key_bias": bias, "gated": True})
                for mode in (sa.TANH_F32, sa.EXACT):
                    args = (lengths, 1 / math.sqrt(D), 0.0, True, mode)
                    for tail in tails:
                        for with_max in (False, True):
                            sa.forward_auto(q, k, v, *args, with_max, **tail)
                        sa.backward_auto(do, q, k, v, *args, **tail)


def ptx(kernel, args: tuple, kwargs: dict, backend) -> str:
    """Compile one launch up to the PTX stage, as Triton's launcher would on an sm_90 device."""
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    opts = backend.parse_options(options.__dict__)
    stages = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(opts)
    module = src.make_ir(TARGET, opts, codegen, backend.get_module_map(), context)
    metadata = {"hash": "offline", "target": TARGET, **opts.__dict__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "ptx":
            return module
    raise RuntimeError("this Triton has no PTX stage")


def variant_name(kernel, args: tuple, kwargs: dict, config, specialization) -> str:
    """``kernel.hash``: the hash of what selects the kernel's code, gated arguments apart."""
    described = lambda v: "tensor" if isinstance(v, torch.Tensor) else v
    flags = sorted(
        (k, v) for k, v in kwargs.items() if k not in GATED_ARGS and not hasattr(v, "base")
    )
    blocks = [str(v.block_shape) for v in kwargs.values() if hasattr(v, "base")]
    gated = sorted((k, described(v)) for k, v in kwargs.items() if k in GATED_ARGS)
    key = [kernel.fn.__name__, specialization(*args), flags, blocks, config.num_warps,
           config.num_stages]  # fmt: skip
    if any(v for _, v in gated):  # a variant without the features hashes as before them
        key.append(gated)
    return f"{kernel.fn.__name__}.{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"


def main(argv: list[str] | None = None) -> list[str]:
    """Writes the PTX files; returns their paths."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="folder for the .ptx files")
    p.add_argument("--gated", action="store_true", help="also causal and key-bias variants")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sa, launches = record_launches(args.gated)
    specialization = importlib.import_module("stabilitylab.kernels.triton_support").specialization
    backend, written = make_backend(TARGET), []
    for kernel, kind, fp32, largs, lkwargs, dense in launches:
        for config in sa._configs(kind, (9, 0), fp32, dense):
            kwargs = {**lkwargs, **config.kwargs}
            if config.pre_hook is not None:  # the dense kernels' descriptor blocks
                config.pre_hook(kwargs)
            path = os.path.join(
                args.out, variant_name(kernel, largs, kwargs, config, specialization) + ".ptx"
            )
            if path in written:
                continue
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            with open(path, "w") as f:
                f.write(ptx(kernel, largs, {**kwargs, **options, "debug": False}, backend))
            written.append(path)
            print(len(written), os.path.basename(path), config, flush=True)
    return written


if __name__ == "__main__":
    main()
