"""Decode attention over a paged KV cache: one query per (sequence, head), split-K, softmax or
sigmoid, the gate's key bias, and each entry's weight as an optional side output.

    z_j = scale q . k_j + kb_j            kb_j = log(g_j + 1e-8), the gate's key bias (0 if none)
    softmax: out = sum_j a_j v_j,  a_j = exp(z_j) / sum_j' exp(z_j')
    sigmoid: out = sum_j a_j v_j,  a_j = sigmoid(z_j + b_b)      (no normalisation)
    score_j += a_j                                              (H2O's accumulated attention)

j runs over the live entries of row (b, h): its logical slots 0 .. count[b, h] - 1, slot n held
in page ``block_table[b, h, n // P]`` at offset ``n % P`` (P = page size). Nothing past
``count`` is read (free pages may hold anything, NaN included). The values are stored already
scaled by the gate, ``g_j v_j``, when it was written (as the research loop stores them:
``stabilitylab/eviction/decode.py``); the kernel reads them as they are and adds only the key bias.

Layout: ``q_BHD``; ``k_pages_PSD``, ``v_pages_PSD`` (pages, page size, head dim; any page and
slot strides, unit stride along D); ``block_table_BHM`` int32 page ids (M pages per row at
most; a (B, 1, M) table expanded over the heads works, strides are honoured);
``count_BH`` int32; per-entry ``key_bias_PS`` float32 and ``score_PS`` float32 / float64,
contiguous (pages, page size), indexed by the same (page, offset) as K and V.

Split-K (flash-decoding): program (r, s) of the first kernel takes slots [s C, (s + 1) C) of row
r (C, the chunk, a multiple of the tile) and leaves a partial: softmax ``(m_s, l_s, acc_s)``
(running max, sum of exp(z - m_s), sum of exp(z - m_s) v), sigmoid ``acc_s``. The merge kernel
combines them: softmax ``out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s`` (M = max m_s),
sigmoid a plain sum. With one split the first kernel writes the output itself.

The score side output: sigmoid weights depend on one entry only, so the first kernel adds them
to ``score_PS`` as it goes. A softmax weight needs the row's log-sum-exp, which no split has
alone; the first kernel stores each entry's z (4 bytes, in a scratch buffer shaped like the
pool) and the merge kernel's program (r, s) adds ``exp(z_j - lse)`` for split s's entries. K and
V are read once; the second look is at 4 bytes per entry, 1/64 of a bf16 K/V entry at D = 64.
No atomics: every entry belongs to one program, so results repeat bit for bit.

Limits: head dim a power of two in [16, 256]; q/k/v in bf16, fp16 or fp32 (accumulation in
fp32); on CPU only in Triton's interpreter. q . k is an elementwise product and a row sum, not
``tl.dot`` (one query row; decode is bound by the K/V reads), so the interpreter's bf16 ``tl.dot``
fault does not apply here. Tile size and split count: ``split_plan`` (measured choices go in
docs/BENCHMARKS.md once the GPU run has them).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.triton_support import (
    SUPPORTED_DTYPES,
    Tuned,
    capability,
    cdiv,
    compiled,
    interpreted,
    interpreter_available,
    interpreting,
    persistent_programs,
)

KINDS = ("softmax", "sigmoid")
MAX_SPLITS = 64
"""The merge kernel holds every split's partial of a row in registers: (splits, D) floats."""
CHUNK_GRANULE = 128
"""Split chunks are multiples of this, so that any tile of the config list (<= 128) divides."""
INTERPRETER_BLOCK_N = 8
SCORE_DTYPES = (torch.float32, torch.float64)


# ---- reference ---------------------------------------------------------------------------------


def row_slots_BHN(block_table_BHM: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat pool slot (``page * P + offset``) of every logical slot n of each row, (B, H, M P)."""
    offset_N = torch.arange(page_size, device=block_table_BHM.device)
    slot_BHMP = block_table_BHM.long()[..., None] * page_size + offset_N
    return slot_BHMP.flatten(-2)


def decode_attention_reference(
    q_BHD: torch.Tensor,
    k_pages_PSD: torch.Tensor,
    v_pages_PSD: torch.Tensor,
    block_table_BHM: torch.Tensor,
    count_BH: torch.Tensor,
    *,
    kind: str,
    sigmoid_bias_B: torch.Tensor | None = None,
    key_bias_PS: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out_BHD, weights_BHN, slot_BHN)`` in q's dtype (float64 for a ground truth): the rows
    gathered into (B, H, N = M P) with the module's formula, weights zero past each row's count,
    ``slot_BHN`` the flat pool slot of each. Same order of operations as the research loop's
    ``attention_weights_BHQN`` (``eviction/decode.py``)."""
    B, H, D = q_BHD.shape
    P = k_pages_PSD.shape[1]
    slot_BHN = row_slots_BHN(block_table_BHM, P)
    live_BHN = torch.arange(slot_BHN.shape[-1], device=q_BHD.device) < count_BH[..., None]
    slot_BHN = slot_BHN.masked_fill(~live_BHN, 0)  # a stale table entry may point anywhere
    k_BHND = k_pages_PSD.flatten(0, 1)[slot_BHN].to(q_BHD.dtype)
    v_BHND = v_pages_PSD.flatten(0, 1)[slot_BHN].to(q_BHD.dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s_BHN = torch.matmul(q_BHD[:, :, None, :], k_BHND.transpose(-1, -2))[:, :, 0] * scale
    if key_bias_PS is not None:
        s_BHN = s_BHN + key_bias_PS.flatten()[slot_BHN].to(s_BHN.dtype)
    if kind == "softmax":
        w_BHN = torch.softmax(s_BHN.masked_fill(~live_BHN, float("-inf")), dim=-1)
        w_BHN = torch.nan_to_num(w_BHN, nan=0.0) if bool((count_BH == 0).any()) else w_BHN
    else:
        b_B11 = sigmoid_bias_B.to(s_BHN.dtype)[:, None, None]
        w_BHN = torch.sigmoid(s_BHN + b_B11)
    # where, not a product: a NaN past the count must not reach the output.
    w_BHN = torch.where(live_BHN, w_BHN, 0.0)
    v_BHND = torch.where(live_BHN[..., None], v_BHND, 0.0)
    out_BHD = torch.matmul(w_BHN[:, :, None, :], v_BHND)[:, :, 0]
    return out_BHD, w_BHN, slot_BHN


def add_scores_reference(score_PS: torch.Tensor, weights_BHN, slot_BHN, count_BH) -> None:
    """``score[slot] += weight`` for every live entry (the kernels' side output, in PyTorch)."""
    live_BHN = torch.arange(slot_BHN.shape[-1], device=slot_BHN.device) < count_BH[..., None]
    flat = score_PS.view(-1)
    flat.index_add_(0, slot_BHN[live_BHN], weights_BHN[live_BHN].to(score_PS.dtype))


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _tile_slots(TABLE, table_row, start, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(page, offset, flat, live)`` of logical slots start .. start + BLOCK_N - 1 of a row: the
    page (int64) and offset in it, the flat pool slot ``page * PAGE + offset``, and whether the
    slot is below ``hi`` (the others read page 0 and are masked by the caller)."""
    n = start + tl.arange(0, BLOCK_N)
    live = n < hi
    page = tl.load(TABLE + table_row + n // PAGE, mask=live, other=0).to(tl.int64)
    offset = n % PAGE
    return page, offset, page * PAGE + offset, live


@triton.jit
def _decode_split_kernel(
    Q, K, V, TABLE, COUNT, KB, SB, SCORE, Z, M_PART, L_PART, ACC, OUT,
    sqb, sqh, skp, sks, svp, svs, stb, sth, scb, sch, sob, soh,
    H, CHUNK, scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr,
    HAS_KB: tl.constexpr, SCORES: tl.constexpr, ONE_SPLIT: tl.constexpr,
):  # fmt: skip
    """Program (r, s): slots [s CHUNK, (s + 1) CHUNK) of row r = b H + h, below its count."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    b = r // H
    h = r % H
    n = tl.load(COUNT + b * scb + h * sch)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + d).to(tl.float32)
    table_row = b.to(tl.int64) * stb + h * sth
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, n)
    bias = 0.0
    if not SOFTMAX:
        bias = tl.load(SB + b)
    m = -float("inf")
    l_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        page, offset, flat, live = _tile_slots(TABLE, table_row, start, hi, PAGE, BLOCK_N)
        k = tl.load(K + page[:, None] * skp + offset[:, None] * sks + d[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        v = tl.load(V + page[:, None] * svp + offset[:, None] * svs + d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        z = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        if HAS_KB:
            z += tl.load(KB + flat, mask=live, other=0.0)
        if SOFTMAX:
            z = tl.where(live, z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(z - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
            if SCORES:
                tl.store(Z + flat, z, mask=live)
        else:
            p = tl.where(live, 1.0 / (1.0 + tl.exp(-(z + bias))), 0.0)
            acc += tl.sum(p[:, None] * v, axis=0)
            if SCORES:
                old = tl.load(SCORE + flat, mask=live, other=0.0)
                tl.store(SCORE + flat, old + p.to(old.dtype), mask=live)
    if ONE_SPLIT:
        if SOFTMAX:  # an empty row (count 0) gives 0
            acc = acc / tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(OUT + b.to(tl.int64) * sob + h * soh + d, acc.to(OUT.dtype.element_ty))
    else:
        part = r * tl.num_programs(1) + s
        tl.store(ACC + part.to(tl.int64) * HEAD_DIM + d, acc)
        if SOFTMAX:
            tl.store(M_PART + part, m)
            tl.store(L_PART + part, l_sum)


@triton.jit
def _softmax_lse(M_PART, L_PART, base, n_splits, S_POW2: tl.constexpr):
    """``(e^(m_s - M), sum_s e^(m_s - M) l_s, M)`` over a row's partials; empty splits have
    m = -inf and weigh 0, and a row with no entry at all gets M = 0, sum 0."""
    splits = tl.arange(0, S_POW2)
    valid = splits < n_splits
    m_s = tl.load(M_PART + base + splits, mask=valid, other=-float("inf"))
    l_s = tl.load(L_PART + base + splits, mask=valid, other=0.0)
    m_max = tl.max(m_s, axis=0)
    m_max = tl.where(m_max == -float("inf"), 0.0, m_max)
    w_s = tl.exp(m_s - m_max)
    return w_s, tl.sum(w_s * l_s, axis=0), m_max


@triton.jit
def _decode_merge_kernel(
    M_PART, L_PART, ACC, OUT, TABLE, COUNT, Z, SCORE,
    stb, sth, scb, sch, sob, soh, H, CHUNK, n_splits,
    HEAD_DIM: tl.constexpr, S_POW2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTMAX: tl.constexpr, SCORES: tl.constexpr,
):  # fmt: skip
    """Program (r, s): s == 0 writes row r's output; with softmax scores, program s also adds
    the weights of split s's entries, ``exp(z - lse)``, to the score buffer."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    b = r // H
    h = r % H
    base = r * n_splits
    d = tl.arange(0, HEAD_DIM)
    w_s = tl.full([S_POW2], 1.0, tl.float32)
    l_all = 1.0
    m_max = 0.0
    if SOFTMAX:
        w_s, l_all, m_max = _softmax_lse(M_PART, L_PART, base, n_splits, S_POW2)
    if s == 0:
        splits = tl.arange(0, S_POW2)
        acc_s = tl.load(ACC + (base + splits).to(tl.int64)[:, None] * HEAD_DIM + d[None, :],
                        mask=(splits < n_splits)[:, None], other=0.0)  # fmt: skip
        out = tl.sum(w_s[:, None] * acc_s, axis=0)
        if SOFTMAX:  # an empty row (count 0) gives 0
            out = out / tl.where(l_all > 0, l_all, 1.0)
        tl.store(OUT + b.to(tl.int64) * sob + h * soh + d, out.to(OUT.dtype.element_ty))
    if SCORES:
        lse = m_max + tl.log(tl.maximum(l_all, 1e-30))  # no entry of an empty row reads it
        n = tl.load(COUNT + b * scb + h * sch)
        table_row = b.to(tl.int64) * stb + h * sth
        lo = s * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        for start in range(lo, hi, BLOCK_N):
            _, _, flat, live = _tile_slots(TABLE, table_row, start, hi, PAGE, BLOCK_N)
            z = tl.load(Z + flat, mask=live, other=0.0)
            old = tl.load(SCORE + flat, mask=live, other=0.0)
            tl.store(SCORE + flat, old + tl.exp(z - lse).to(old.dtype), mask=live)


# ---- launch plan and configs -------------------------------------------------------------------


def split_plan(
    rows: int, max_slots: int, programs: int, num_splits: int | None = None,
    granule: int = CHUNK_GRANULE,
) -> tuple[int, int]:  # fmt: skip
    """``(splits, chunk)``: split each row's ``max_slots`` logical slots into chunks of
    ``chunk`` slots (a multiple of ``granule``), enough splits that ``rows x splits`` is about
    two programs per SM (``programs``), at most ``MAX_SPLITS``; ``num_splits`` asks for a number
    (the chunk rounding may give fewer). Every split but the last is full at the capacity; rows
    with fewer live slots leave the last splits empty (those programs exit at once)."""
    granules = max(1, cdiv(max_slots, granule))
    want = num_splits if num_splits is not None else cdiv(2 * programs, max(rows, 1))
    splits = max(1, min(want, granules, MAX_SPLITS))
    chunk = cdiv(granules, splits) * granule
    return cdiv(granules * granule, chunk), chunk


@functools.cache
def _configs(cap: tuple[int, int]) -> tuple[triton.Config, ...]:
    """Tiles of 32-128 slots; decode is bound by K/V reads, so more warps in flight can help."""
    return tuple(
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
        for n, w, st in ((64, 4, 2), (128, 4, 2), (128, 8, 2), (32, 2, 2), (64, 2, 3))
    )


PINNED = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
"""The config of launches that change a buffer in place (the score side output): the autotuner
would run them once per config and add the weights that many times."""

_TUNED: dict[tuple, Tuned] = {}


def _tuned(device: torch.device) -> Tuned:
    cap = capability(device)
    if cap not in _TUNED:
        keys = ["HEAD_DIM", "PAGE", "SOFTMAX", "HAS_KB", "ONE_SPLIT", "CHUNK"]
        _TUNED[cap] = Tuned(_decode_split_kernel, _configs(cap), keys)
    return _TUNED[cap]


# ---- launcher ----------------------------------------------------------------------------------


def _launch(q, k, v, table, count, key_bias, bias_B, score, scale, softmax, num_splits, out):
    """Both kernels on validated inputs; ``score`` updated in place when given."""
    B, H, D = q.shape
    P = k.shape[1]
    granule = INTERPRETER_BLOCK_N if interpreting() else CHUNK_GRANULE
    splits, chunk = split_plan(
        B * H, table.shape[2] * P, persistent_programs(q.device), num_splits, granule
    )
    scores = score is not None
    one = splits == 1 and not (scores and softmax)
    f32 = dict(dtype=torch.float32, device=q.device)
    m_part = torch.empty(B * H * splits, **f32)
    l_part = torch.empty(B * H * splits, **f32)
    acc = torch.empty(B * H * splits, D, **f32)
    z = torch.empty(k.shape[:2], **f32) if scores and softmax else m_part
    kb = key_bias if key_bias is not None else m_part
    sb = bias_B if bias_B is not None else m_part
    sc = score if scores else m_part
    args = (
        q, k, v, table, count, kb, sb, sc, z, m_part, l_part, acc, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        table.stride(0), table.stride(1), count.stride(0), count.stride(1),
        out.stride(0), out.stride(1), H, chunk, scale,
    )  # fmt: skip
    flags = dict(HEAD_DIM=D, PAGE=P, SOFTMAX=softmax, HAS_KB=key_bias is not None,
                 SCORES=scores, ONE_SPLIT=one)  # fmt: skip
    if interpreting():
        block = {"BLOCK_N": INTERPRETER_BLOCK_N}
        interpreted(_decode_split_kernel)[(B * H, splits)](*args, **flags, **block)
    elif scores:
        block = PINNED
        compiled(_decode_split_kernel)[(B * H, splits)](*args, **flags, **block)
    else:
        tuned = _tuned(q.device)
        key = (D, P, softmax, key_bias is not None, one, chunk, q.dtype)
        tuned.launch((B * H, splits), key, *args, **flags)
        block = tuned._best.get(key, PINNED)
    if not one:
        _merge(m_part, l_part, acc, out, table, count, z, sc, splits, chunk, softmax, scores,
               P, block)  # fmt: skip
    return out


def _merge(m_part, l_part, acc, out, table, count, z, score, splits, chunk, softmax, scores,
           P, block):  # fmt: skip
    B, H, D = out.shape
    grid = (B * H, splits if (scores and softmax) else 1)
    kernel = interpreted(_decode_merge_kernel) if interpreting() else compiled(_decode_merge_kernel)
    kernel[grid](
        m_part, l_part, acc, out, table, count, z, score,
        table.stride(0), table.stride(1), count.stride(0), count.stride(1),
        out.stride(0), out.stride(1), H, chunk, splits,
        HEAD_DIM=D, S_POW2=max(2, triton.next_power_of_2(splits)), PAGE=P,
        BLOCK_N=block.get("BLOCK_N", INTERPRETER_BLOCK_N), SOFTMAX=softmax,
        SCORES=scores and softmax, num_warps=4,
    )  # fmt: skip


# ---- validation --------------------------------------------------------------------------------


def _check_tensor(name, t, rank, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; use one of {dtypes}")
    if device is not None and t.device != device:
        raise ValueError(f"device mismatch: q_BHD {device} vs {name} {t.device}")


def _check_device(q: torch.Tensor) -> None:
    if q.device.type == "cuda":
        return
    if q.device.type != "cpu":
        raise ValueError(f"unsupported device {q.device}; use cuda (or cpu with the interpreter)")
    if not interpreting():
        raise ValueError(
            "inputs are CPU tensors but TRITON_INTERPRET is not '1'; move them to CUDA, set "
            "TRITON_INTERPRET=1 before starting Python, or use decode_attention_reference"
        )
    if not interpreter_available():
        raise ValueError(
            "TRITON_INTERPRET=1 was set after triton was imported, so Triton's CPU interpreter "
            "cannot run here; set it before starting Python"
        )


def _check_pool(q, k, v, table, count):
    _check_tensor("q_BHD", q, 3, SUPPORTED_DTYPES, None)
    B, H, D = q.shape
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim D={D} must be a power of two in [16, 256]")
    for name, t in (("k_pages_PSD", k), ("v_pages_PSD", v)):
        _check_tensor(name, t, 3, (q.dtype,), q.device)
        if t.shape[2] != D or t.stride(2) != 1:
            raise ValueError(
                f"{name} must be (pages, page size, D={D}) with unit stride along D, got shape "
                f"{tuple(t.shape)}, strides {t.stride()}"
            )
    if k.shape != v.shape:
        raise ValueError(f"shape mismatch: k_pages_PSD {tuple(k.shape)} vs v_pages_PSD {tuple(v.shape)}")  # fmt: skip
    _check_tensor("block_table_BHM", table, 3, (torch.int32,), q.device)
    _check_tensor("count_BH", count, 2, (torch.int32,), q.device)
    if table.shape[:2] != (B, H) or count.shape != (B, H):
        raise ValueError(
            f"block_table_BHM {tuple(table.shape)} and count_BH {tuple(count.shape)} must "
            f"start with (B, H) = {(B, H)}"
        )


def _check_entry_buffer(name, t, k, dtypes):
    if t is None:
        return
    _check_tensor(name, t, 2, dtypes, k.device)
    if t.shape != k.shape[:2] or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous (pages, page size) = {tuple(k.shape[:2])} tensor, got "
            f"shape {tuple(t.shape)}"
        )


def _sigmoid_bias(kind, sigmoid_bias, q):
    """The per-sequence bias as a float32 (B,) tensor (sigmoid), None (softmax)."""
    if kind == "softmax":
        if sigmoid_bias is not None:
            raise ValueError("sigmoid_bias is for kind='sigmoid'; softmax takes none")
        return None
    B = q.shape[0]
    if isinstance(sigmoid_bias, numbers.Real) and not isinstance(sigmoid_bias, bool):
        if not math.isfinite(sigmoid_bias):
            raise ValueError(f"sigmoid_bias must be finite, got {sigmoid_bias}")
        return torch.full((B,), float(sigmoid_bias), dtype=torch.float32, device=q.device)
    if not isinstance(sigmoid_bias, torch.Tensor) or tuple(sigmoid_bias.shape) != (B,):
        got = tuple(sigmoid_bias.shape) if isinstance(sigmoid_bias, torch.Tensor) else sigmoid_bias
        raise ValueError(f"kind='sigmoid' needs sigmoid_bias, a float or a ({B},) tensor; got {got!r}")  # fmt: skip
    if sigmoid_bias.device != q.device:
        raise ValueError(f"device mismatch: q_BHD {q.device} vs sigmoid_bias {sigmoid_bias.device}")  # fmt: skip
    return sigmoid_bias.to(torch.float32).contiguous()


def _check_counts(count: torch.Tensor, capacity: int) -> None:
    """0 <= count <= M P: one device read, skipped while a CUDA graph is captured."""
    if count.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = (int(x) for x in torch.stack(torch.aminmax(count)).tolist())
    if lo < 0 or hi > capacity:
        raise ValueError(
            f"count_BH must lie in [0, {capacity}] (the block table's pages x page size), got "
            f"min {lo}, max {hi}"
        )


# ---- public function ---------------------------------------------------------------------------


def decode_attention(
    q_BHD: torch.Tensor,
    k_pages_PSD: torch.Tensor,
    v_pages_PSD: torch.Tensor,
    block_table_BHM: torch.Tensor,
    count_BH: torch.Tensor,
    *,
    kind: str,
    sigmoid_bias: float | torch.Tensor | None = None,
    key_bias_PS: torch.Tensor | None = None,
    score_PS: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    out_BHD: torch.Tensor | None = None,
    check_counts: bool = True,
) -> torch.Tensor:
    """``out_BHD`` (q's dtype) of each row's query over its live entries; see the module
    docstring for formula and layout. ``kind``: softmax | sigmoid; ``sigmoid_bias`` (sigmoid
    only): b, a float or one per sequence (B,); ``key_bias_PS``: each entry's key bias;
    ``score_PS``: when given, each entry's weight this step is added to it in place;
    ``num_splits``: split-K programs per row (None: ``split_plan`` picks); ``out_BHD``: write
    the output there (a static buffer under a CUDA graph); ``check_counts=False`` skips the
    counts' range check (a device read) for a caller that keeps them in range itself."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    _check_pool(q_BHD, k_pages_PSD, v_pages_PSD, block_table_BHM, count_BH)
    _check_entry_buffer("key_bias_PS", key_bias_PS, k_pages_PSD, (torch.float32,))
    _check_entry_buffer("score_PS", score_PS, k_pages_PSD, SCORE_DTYPES)
    bias_B = _sigmoid_bias(kind, sigmoid_bias, q_BHD)
    if scale is not None and not (isinstance(scale, numbers.Real) and 0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    if q_BHD.stride(2) != 1:
        q_BHD = q_BHD.contiguous()
    if out_BHD is None:
        out_BHD = torch.empty_like(q_BHD)
    elif out_BHD.shape != q_BHD.shape or out_BHD.dtype != q_BHD.dtype or out_BHD.stride(2) != 1:
        raise ValueError(f"out_BHD must be a {tuple(q_BHD.shape)} {q_BHD.dtype} tensor")
    _check_device(q_BHD)
    if check_counts:
        _check_counts(count_BH, block_table_BHM.shape[2] * k_pages_PSD.shape[1])
    scale = 1.0 / math.sqrt(q_BHD.shape[2]) if scale is None else float(scale)
    return _launch(
        q_BHD, k_pages_PSD, v_pages_PSD, block_table_BHM, count_BH, key_bias_PS, bias_B,
        score_PS, scale, kind == "softmax", num_splits, out_BHD,
    )  # fmt: skip
