"""Synthetic single-cell transcriptomes with learnable structure, rank-value encoded.

The world (fixed by the seed and the DataConfig):

- gene baseline ``base_G``: log-normal with a very heavy tail (``BASE_SIGMA``) plus boosted
  housekeeping genes, so the non-program genes a cell picks up are mostly the same few;
- ``n_programs`` co-regulated programs, each ``genes_per_program`` genes drawn independently
  (so programs overlap) with log-normal loadings ``load_PK`` summing to 1 per program;
- ``n_cell_types`` types, each activating a sparse mix: its identity program (t mod P) and 1-2
  shared ones, with weights ``pi_t``.

A cell of type t, library size L (log-normal) and program activities ``a_p`` (log-normal noise
around 1) has expected counts::

    mu_g = L * ((1 - s) * base_g + s * sum_p pi_tp * a_p * load_pg),   s = PROGRAM_SHARE

and observed counts ``c_g ~ ZINB``: with probability ``dropout_rate`` the gene is not captured
(0), else negative binomial with mean ``mu_g`` and shape r = ``dispersion`` (variance
``mu + mu^2 / r``). Its tokens are the expressed genes ranked by ``c_g / typical_g``, where
``typical_g`` is the gene's mean non-zero count over cell types at the median library size (the
generator's analogue of Geneformer's non-zero median), truncated to ``context_len``. A cell with
fewer than ``min_genes`` expressed genes fails quality control and is redrawn, as a QC filter
would drop it.

Learnable by construction: the top ranks are the genes of the type's programs ordered roughly by
loading, so a masked rank is predictable from the other genes (they reveal the type). The median
library size is calibrated so that the median cell expresses ``LENGTH_TARGET * context_len``
genes; the wide ``LIB_SIGMA`` spreads lengths from a few hundred genes to the cap (stress_8k:
~27% of cells at 8192, 5% below ~1500). The constants were tuned on the smoke model's loss after
300 steps; see the tests for the learnability check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stabilitylab.config import DataConfig
from stabilitylab.data.source import (
    CellSource,
    DataError,
    check_index,
    check_seed,
    rank_value_order,
)

PROGRAM_SHARE = 0.95
"""Fraction of a cell's expected counts that comes from its programs."""
MAX_SHARED_PROGRAMS = 2
IDENTITY_WEIGHT = 2.0
"""Added to the identity program's gamma(2) mixing weight before normalising."""
HOUSEKEEPING_FRACTION = 0.02
HOUSEKEEPING_BOOST = 30.0
BASE_SIGMA = 4.0
LOADING_SIGMA = 1.5
ACTIVITY_SIGMA = 0.25
LIB_SIGMA = 2.5
LENGTH_TARGET = 0.7
"""The median cell expresses this fraction of context_len genes before truncation."""
N_SYNTHETIC_CELLS = 2**40
MAX_QC_REDRAWS = 64
CALIBRATION_TYPES = 8
"""Cell types the library-size calibration averages over (cost: types x genes per step)."""
# Inverse-CDF sampling takes ~ mean + log(1e-6)/log(q) vectorised steps; past these the
# gamma-Poisson draw is cheaper.
INVERSE_CDF_MAX_Q = 0.6
INVERSE_CDF_MAX_MEAN = 4.0
# Rounding can leave the running CDF a hair below a uniform draw within 1e-16 of 1; at q <= 0.6
# the pmf is below 1e-200 long before this many steps.
MAX_INVERSE_CDF_STEPS = 1000

_WORLD_STREAM = 0
_CELL_STREAM = 1


@dataclass(frozen=True)
class World:
    """Everything fixed for a (seed, DataConfig): expression model and calibration."""

    base_G: np.ndarray
    """(1 - s) * baseline share per gene, float64, sums to 1 - s."""
    type_genes: list[np.ndarray]
    """Per type: genes of its programs, concatenated (int64; a gene may repeat)."""
    type_loads: list[np.ndarray]
    """Per type: s * pi_tp * load_pg aligned with ``type_genes``."""
    type_slots: list[np.ndarray]
    """Per type: which active program (0..n_active-1) each entry belongs to."""
    typical_G: np.ndarray
    """Mean non-zero count per gene at the median library size; the rank normaliser."""
    lib_median: float
    housekeeping: np.ndarray
    dispersion: float
    dropout_rate: float

    @property
    def n_genes(self) -> int:
        return self.base_G.shape[0]

    @property
    def n_cell_types(self) -> int:
        return len(self.type_genes)

    def expected_share(self, cell_type: int, activity: np.ndarray | None = None) -> np.ndarray:
        """``w_G``: expected fraction of a cell's counts per gene (sums to ~1)."""
        w_slot = self.type_loads[cell_type]
        if activity is not None:
            w_slot = w_slot * activity[self.type_slots[cell_type]]
        prog_G = np.bincount(self.type_genes[cell_type], weights=w_slot, minlength=self.n_genes)
        return self.base_G + prog_G


def nb_zero_prob(mu: np.ndarray, r: float) -> np.ndarray:
    """P(c = 0) for a negative binomial with mean mu and shape r: ``(r / (r + mu))^r``."""
    return (r / (r + mu)) ** r


def sample_zinb_nonzero(
    rng: np.random.Generator, mu_G: np.ndarray, dispersion: float, dropout_rate: float
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``c_G ~ ZINB(mu_G, r, dropout)`` and return only the non-zero (genes_N, counts_N).

    Exact up to float32 rounding of P0, and ~3x cheaper than a gamma and a Poisson draw per gene
    (4 ms at 44k genes): one float32 uniform per gene decides zero / non-zero against
    ``d + (1 - d) P0`` (gene not captured, or NB zero), then only the
    non-zero genes get a count from the NB conditioned on c >= 1 - by inverse CDF for small means
    (pmf recursion ``P(k) = P(k-1) (k - 1 + r) / k * q``, q = mu / (r + mu)) and by gamma-Poisson
    with zeros redrawn for large ones, where P0 is small.
    """
    r = float(dispersion)
    mu32_G = mu_G.astype(np.float32, copy=False)
    u_G = rng.random(mu32_G.shape[0], dtype=np.float32)
    threshold_G = np.float32(dropout_rate) + np.float32(1 - dropout_rate) * nb_zero_prob(mu32_G, r)
    genes_N = np.flatnonzero(u_G >= threshold_G)
    counts_N = np.ones(genes_N.shape[0], dtype=np.int64)
    mu_N = mu_G[genes_N].astype(np.float64)
    q_N = mu_N / (r + mu_N)

    small = (q_N <= INVERSE_CDF_MAX_Q) & (mu_N <= INVERSE_CDF_MAX_MEAN)
    pos = np.flatnonzero(small)
    q = q_N[pos]
    p0 = nb_zero_prob(mu_N[pos], r)
    v = p0 + (1.0 - p0) * rng.random(pos.shape[0])  # uniform on (P0, 1): the c >= 1 part of the CDF
    pmf = p0 * r * q
    cdf = p0 + pmf
    k = 1
    while pos.size and k < MAX_INVERSE_CDF_STEPS:
        more = v > cdf
        pos, q, v, pmf, cdf = pos[more], q[more], v[more], pmf[more], cdf[more]
        k += 1
        pmf = pmf * ((k - 1 + r) / k) * q
        cdf = cdf + pmf
        counts_N[pos] = k

    pos = np.flatnonzero(~small)
    while pos.size:
        mu = mu_N[pos]
        c = rng.poisson(rng.standard_gamma(r, mu.shape[0], dtype=np.float32) * (mu / r))
        counts_N[pos] = c
        pos = pos[c == 0]
    return genes_N.astype(np.int64), counts_N


def _expected_length(lib: float, w_SG: np.ndarray, r: float, dropout_rate: float) -> float:
    """Mean expressed genes over the cell types ``w_SG`` at library size ``lib``."""
    p_nonzero_SG = (1.0 - dropout_rate) * (1.0 - nb_zero_prob(lib * w_SG, r))
    return float(p_nonzero_SG.sum(axis=1).mean())


def _calibrate_library(w_SG: np.ndarray, r: float, dropout_rate: float, target: float) -> float:
    """Library size L at which cells of the types ``w_SG`` express ``target`` genes on average."""
    lo, hi = np.log(1e-3), np.log(1e12)
    reachable = _expected_length(np.exp(hi), w_SG, r, dropout_rate)
    if reachable < target:
        raise DataError(
            f"synthetic data: cells cannot express {target:.0f} genes on average with "
            f"n_genes={w_SG.shape[1]} and dropout_rate={dropout_rate} (at most {reachable:.0f}); "
            "raise n_genes or lower context_len / min_genes / dropout_rate"
        )
    for _ in range(40):  # bisection on log L to ~1e-10 relative: length is monotone in L
        mid = 0.5 * (lo + hi)
        if _expected_length(np.exp(mid), w_SG, r, dropout_rate) < target:
            lo = mid
        else:
            hi = mid
    return float(np.exp(hi))


def build_world(cfg: DataConfig, seed: int) -> World:
    """The fixed expression model for ``(seed, cfg)``; deterministic, ~0.1 s at 44k genes."""
    seed = check_seed(seed)
    rng = np.random.default_rng([seed, _WORLD_STREAM])
    G, P, K = cfg.n_genes, cfg.n_programs, cfg.n_cell_types
    s = PROGRAM_SHARE

    base_G = rng.lognormal(0.0, BASE_SIGMA, G)
    housekeeping = np.sort(rng.choice(G, max(1, int(HOUSEKEEPING_FRACTION * G)), replace=False))
    base_G[housekeeping] *= HOUSEKEEPING_BOOST
    base_G *= (1.0 - s) / base_G.sum()

    prog_genes_PK = np.stack(
        [rng.choice(G, cfg.genes_per_program, replace=False) for _ in range(P)]
    )
    load_PK = rng.lognormal(0.0, LOADING_SIGMA, prog_genes_PK.shape)
    load_PK /= load_PK.sum(axis=1, keepdims=True)

    # Type t's identity program is t mod P; its shared programs (cell cycle, stress, ...) come
    # from the programs no type owns when there are any, so types stay distinguishable.
    shared_pool = np.arange(K, P) if P > K else np.arange(P)
    type_genes, type_loads, type_slots = [], [], []
    for t in range(K):
        identity = t % P
        pool = shared_pool[shared_pool != identity]
        n_shared = int(min(pool.shape[0], rng.integers(1, MAX_SHARED_PROGRAMS + 1)))
        progs = np.concatenate([[identity], rng.choice(pool, n_shared, replace=False)])
        pi = rng.gamma(2.0, 1.0, progs.shape[0])
        pi[0] += IDENTITY_WEIGHT
        pi /= pi.sum()
        n_active = progs.shape[0]
        type_genes.append(prog_genes_PK[progs].reshape(-1).astype(np.int64))
        type_loads.append((s * pi[:, None] * load_PK[progs]).reshape(-1))
        type_slots.append(np.repeat(np.arange(n_active), cfg.genes_per_program))

    # Calibration needs the shares, and the shares need a World: fill in typical_G and
    # lib_median once they are known.
    world = World(
        base_G=base_G,
        type_genes=type_genes,
        type_loads=type_loads,
        type_slots=type_slots,
        typical_G=np.ones(G),
        lib_median=1.0,
        housekeeping=housekeeping,
        dispersion=cfg.dispersion,
        dropout_rate=cfg.dropout_rate,
    )
    w_KG = np.stack([world.expected_share(t) for t in range(K)])
    target = max(LENGTH_TARGET * cfg.context_len, 2.0 * cfg.min_genes)
    calib_types = np.linspace(0, K - 1, min(K, CALIBRATION_TYPES)).astype(np.int64)
    lib_median = _calibrate_library(w_KG[calib_types], cfg.dispersion, cfg.dropout_rate, target)

    # Mean non-zero count E[c | c > 0] = mu / (1 - P0), averaged over types; -> 1 for rare genes,
    # so a stray single count never outranks a gene expressed far above its usual level.
    mu_KG = lib_median * w_KG
    typical_G = (mu_KG / np.maximum(1.0 - nb_zero_prob(mu_KG, cfg.dispersion), 1e-12)).mean(axis=0)
    return dataclasses.replace(world, typical_G=np.maximum(typical_G, 1.0), lib_median=lib_median)


class SyntheticSource(CellSource):
    """Cells of one synthetic world; ``cell(index)`` depends on (seed, index) alone."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.seed = check_seed(seed)
        self.cfg = cfg
        self.world = build_world(cfg, self.seed)
        self.n_genes = cfg.n_genes
        self.gene_names = [f"G{g:05d}" for g in range(cfg.n_genes)]
        self.context_len = cfg.context_len

    def __len__(self) -> int:
        return N_SYNTHETIC_CELLS

    def cell_type(self, index: int) -> int:
        """The type the cell at ``index`` was drawn from (for probes of learned representations)."""
        rng = np.random.default_rng([self.seed, check_index(index), _CELL_STREAM])
        return int(rng.integers(self.world.n_cell_types))

    def counts(self, index: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(cell_type, genes_N, counts_N): the cell's non-zero counts before rank encoding."""
        rng = np.random.default_rng([self.seed, check_index(index), _CELL_STREAM])
        w = self.world
        t = int(rng.integers(w.n_cell_types))
        n_slots = int(w.type_slots[t][-1]) + 1
        for attempt in range(MAX_QC_REDRAWS):
            lib = w.lib_median * np.exp(LIB_SIGMA * rng.standard_normal())
            if attempt >= MAX_QC_REDRAWS // 2:  # keeps the redraw loop finite in odd configs
                lib *= 2.0 ** (attempt - MAX_QC_REDRAWS // 2)
            activity = np.exp(
                ACTIVITY_SIGMA * rng.standard_normal(n_slots) - 0.5 * ACTIVITY_SIGMA**2
            )
            mu_G = lib * w.expected_share(t, activity)
            genes_N, counts_N = sample_zinb_nonzero(rng, mu_G, w.dispersion, w.dropout_rate)
            if genes_N.shape[0] >= self.cfg.min_genes:
                return t, genes_N, counts_N
        raise DataError(
            f"synthetic data: cell {index} expressed fewer than min_genes={self.cfg.min_genes} "
            f"genes in {MAX_QC_REDRAWS} draws; lower data.min_genes"
        )

    def cell(self, index: int) -> np.ndarray:
        _, genes_N, counts_N = self.counts(index)
        scores_N = counts_N / self.world.typical_G[genes_N]
        return rank_value_order(genes_N, scores_N, self.n_genes, self.context_len)
