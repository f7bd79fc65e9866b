"""Benchmark: held-out perplexity of centralised training vs 3-site DiLoCo vs FedAvg vs 1-site
DiLoCo, at matched tokens, matched optimiser steps and matched combined per-step batch.

All runs train crossfed's tiny Qwen3 (``--flavour small`` for five times its parameters) on
the embedded corpus, in this process, with the inner phase the sites run
(``crossfed.train.inner``) and the coordinator's outer step (``crossfed.outer.outer_step``),
no coordinator in between. Every round the data come from a
DARL block permutation: site i's step h of round r trains the same windows in every variant,
and the centralised step trains the three sites' step-h windows together, so every variant
sees the same windows in the same number of sequential optimiser steps (the paper's control:
Photon's federated advantage came from ~8x more steps). The learning-rate schedule is indexed
by the global step in all of them: the workflow's for a new run (a linear warmup over a tenth
of the run's steps, ``--warmup-steps`` to set it, then a cosine to half the peak,
``--min-lr-factor`` to set it). Every DiLoCo-style row crosses the workflow's wire: its
sites train from the global model as the coordinator publishes it (the fp32 master cast to
bf16) and send bf16 deltas measured against it, while the outer step runs on the fp32 master
(``--global-dtype`` / ``--delta-dtype fp32`` make either side lossless).

* centralised: one model, batch 3*B, T AdamW steps;
* DiLoCo 3 sites: three sites of batch B, H inner steps per round (R = T / H rounds), the
  outer step of ``--outer`` (a preset of ``crossfed.outer_presets.PRESETS``: ``average``, the
  workflow's default, eta=1 and beta=0 for any number of sites; ``tuned``, the default
  before it, beta=0 and eta=1/sqrt(M); or ``paper``, eta=0.7 and beta=0.9 with the solo full
  step; or ``eta=E,beta=B[,solo=0|1]``), inner AdamW state kept per site across rounds
  (``--adam-state``: ``shared``, the workflow's default, rescales each site's second moment to
  the token-weighted mean of the sites' row and column factors at each merge; ``keep``,
  reset, or whole moments averaged are levers to measure), the token embedding's rows
  weighted by how often each site saw each token (``--embedding-rows``: ``counts``, the
  workflow's default, ``crossfed.rowcounts``; the overlapped row counts the windows after
  its fold-in, or with ``--overlap-counts all`` its stale steps' too; ``shares`` weights
  them as every other tensor, by the token shares);
* FedAvg: the same with beta=0, eta=1 (the token-weighted mean of the site models; with the
  ``average`` preset it is the DiLoCo row itself, trained once);
* DiLoCo 1 site: one site of batch 3*B with the same outer step as the DiLoCo row;
* noise floor: a lone site with eta 1 and no momentum over a lossless (fp32) wire, which is
  centralised training up to fp32 rounding: how far two runs that differ only in rounding
  land apart, the spread any ratio here must beat to mean something;
* DiLoCo 3 sites, overlap: the DiLoCo row with overlapped rounds (``crossfed.train.overlap``).
  Same sites, leases and outer step, but each site keeps its own weights across rounds: it
  sends round r-1's delta and at once trains round r's lease from those weights (the stale
  base), and the merged model of round r-1 arrives ``tau`` steps into round r's phase. There
  the site folds it in (``fold_in(theta, sent, merged)``, ``sent`` its weights when it sent
  its delta) and trains the remaining H - tau steps; its delta is measured against that
  merged model, as in the DiLoCo row. Round 1 has nothing to fold in and is the plain round.
  ``--overlap-delay F`` sets tau = max(1, round(F * H)) capped at H (Python's round, half to
  even: F=0.5 gives tau=2 at H=3 and at H=5); F=0 gives tau=0, the merged model arriving
  before the first step (with ``rebase`` exactly the DiLoCo row; ``mix`` still mixes).
  ``--overlap-rule`` ``rebase`` (default; the delayed outer update of Kale et al. 2025,
  arXiv 2502.12996: theta <- merged + theta - sent) or ``mix`` (Streaming DiLoCo, Douillard
  et al. 2025, arXiv 2501.18512: theta <- alpha * theta + (1 - alpha) * merged, alpha from
  ``--overlap-alpha``, default 0.5). ``--overlap-stale-weight W`` (default the workflow's
  ``overlap.stale_weight``, 1) keeps the stale steps with weight W in the rebase:
  theta <- merged + W * (theta - sent). ``--overlap-eager``, ``--overlap-counts all`` and
  ``--overlap-embedding merged`` are levers and diagnostics of the stale steps
  (docs/quality.md).

``--early-rounds N --early-h E`` makes the first N rounds E inner steps long and the rest H,
over the same T steps and the same windows in the same order (post-local SGD, Lin et al.
2020, arXiv 1808.07217: merge often while the model moves fastest, then rarely), what the
workflow's ``inner.early_rounds`` and ``inner.early_steps`` train. ``--late-rounds N --late-h
L`` makes the last N rounds L steps long (merging more often while the learning rate decays;
a lever the workflow does not have).

``--regime long`` (the default) is where users run: the workflow's H=25 over 40 rounds
(1,000 steps) and the paper's H=100 over 20 (2,000 steps), about 0.7 and 1.3 epochs of the
embedded corpus at B=4 (a lease past the end of the data continues with the next epoch's
permutation, as DARL's epochs do); ``--regime short`` is H=3 and H=5 over 150 steps, minutes
instead of an hour. ``--overlap-delay`` defaults to the workflow's ``overlap.max_stale`` (a
quarter of the phase). Each H of ``--inner-steps`` and each seed of ``--seeds`` (model seed
s, block order 1234 + s) is one set of runs; the table gives mean and sample standard
deviation over seeds. The last line is one JSON object: per-H summaries, and ``ratio``
(DiLoCo 3 sites / centralised) and ``solo_over_centralised``, each the mean over seeds and H
values (the paper's ratio is 34.7 / 28.2 = 1.23), and ``overlap_over_plain`` (overlap row /
DiLoCo 3 sites, the same mean) with ``overlap`` (rule, alpha, delay fraction, tau per H);
per H, ``ratio_h<H>``, ``solo_h<H>`` and ``floor_h<H>`` (means over seeds); ``outer_run``,
the (eta, beta) each row's outer steps ran with by number of contributors. Runs are
deterministic on one machine: the same command prints the same figures.

Where the bench differs from the workflow: every site leases exactly H steps of windows in
every round (the workflow's round 1 is a probe of a quarter phase, and later leases follow
each site's pace), sites train one after another in one process, and the overlap row's
merged model arrives a fixed tau steps into the phase (the workflow's arrives when the merge
is done, at most ``overlap.max_stale`` of the phase in). A DARL block is 16 consecutive
windows (``--block-size``; the workflow's ``data.block_size`` is 8), so at B=4 a site's step
trains a quarter of one block, where a real site's step spans many blocks: ``--block-size 1``
is the closer setting, and there centralised training gains more than the sites
(docs/quality.md, "The order of a site's windows").

    .venv/bin/python bench/quality.py --threads 1 --jobs 3    # hours on 2 cores
    .venv/bin/python bench/quality.py --threads 1 --jobs 3 --inner-steps 25   # H=25 only
    .venv/bin/python bench/quality.py --regime short --outer tuned --threads 1 --jobs 3
    .venv/bin/python bench/quality.py --outer paper tuned --variants centralised diloco
    .venv/bin/python bench/quality.py --outer paper --inner-steps 10 --steps 80 --batch 8 \
        --seeds 0 --global-dtype fp32                          # the issue-18 figures
    .venv/bin/python bench/quality.py --threads 1 --jobs 3 --variants diloco overlap \
        --overlap-rule mix --overlap-alpha 0.5                 # the mix rule against plain
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from crossfed import moments, rowcounts
from crossfed.darl.blockspace import BlockSpace
from crossfed.data.prepare import prepare
from crossfed.data.windows import WindowStore
from crossfed.outer import outer_step, token_shares
from crossfed.outer_presets import AVERAGE_STEP, DEFAULT_PRESET, PRESETS, TUNED_BETA, OuterConfig
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    PhaseState,
    Trainer,
    decay_groups,
    evaluate,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import LOCAL_FLAVOURS, build_model, load_parameters, parameters_of
from crossfed.train.overlap import RULES, OverlapConfig, OverlapConfigError, fold_in
from crossfed.train.schedule import DEFAULT_MIN_LR_FACTOR, LRSchedule, default_warmup_steps
from crossfed.wire.deltas import delta_of

PAPER_RATIO = 34.7 / 28.2
FEDAVG = "FedAvg (beta=0, eta=1)"
VARIANTS = ("centralised", "diloco", "fedavg", "solo", "overlap", "floor")
#: the noise floor's row: a lone site, eta 1, no momentum, over a lossless wire
FLOOR = "noise floor: 1 site, eta 1, fp32 wire"
#: the --adam-state choices that average AdamW moments over the sites, and which moments
ADAM_AVERAGES: dict[str, tuple[str, ...]] = {
    "average": ("exp_avg", "exp_avg_sq"),
    "average-m": ("exp_avg",),
    "average-v": ("exp_avg_sq",),
}
#: ``shared``: the workflow's (``inner.second_moment: shared``, crossfed.moments);
#: ``keep``: each site's own (``inner.second_moment: own``)
ADAM_STATES = ("shared", "keep", "reset", *ADAM_AVERAGES)
#: H -> optimiser steps T of each named regime (R = T / H rounds)
REGIMES: dict[str, dict[int, int]] = {
    "long": {25: 1000, 100: 2000},  # the workflow's H over 40 rounds, the paper's over 20
    "short": {3: 150, 5: 150},  # 50 and 30 rounds: minutes
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Wire:
    """What crosses the network: the global model the sites download and the deltas they
    send. The workflow's is bf16 both ways (``crossfed.coordinator.generations`` publishes the
    master in bf16; ``transport.compress: none`` sends bf16 deltas)."""

    global_dtype: torch.dtype = torch.bfloat16
    delta_dtype: torch.dtype = torch.bfloat16


WORKFLOW_WIRE = Wire()
LOSSLESS = Wire(torch.float32, torch.float32)


def site_windows(
    space: BlockSpace, sites: int, batch: int, steps: int | list[int], rounds: int
) -> list[list[list[int]]]:
    """Dataset windows per round and site: ``out[r][i]`` is site i's lease, in step order.
    ``steps``: every round's inner steps, or a list of each round's (``round_lengths``).

    The windows follow DARL's epochs: the block permutation of epoch 0, then epoch 1's, and
    so on, as a run that outlasts one pass over the data leases them."""
    lengths = steps if isinstance(steps, list) else [steps] * rounds
    if len(lengths) != rounds:
        raise ValueError(f"{len(lengths)} round lengths for {rounds} rounds")
    need = batch * sum(lengths) * sites
    order: list[int] = []
    epoch = 0
    while len(order) < need:
        order += [w for b in space.permutation(epoch) for w in space.block_windows(int(b))]
        epoch += 1
    out, cursor = [], 0
    for length in lengths:
        per_site = batch * length
        leases = []
        for _ in range(sites):
            leases.append(order[cursor : cursor + per_site])
            cursor += per_site
        out.append(leases)
    return out


def round_lengths(H: int, T: int, early_rounds: int = 0, early_h: int = 0,
                  late_rounds: int = 0, late_h: int = 0) -> list[int]:  # fmt: skip
    """Each round's inner steps over T optimiser steps: ``early_rounds`` rounds of
    ``early_h`` steps first (more frequent merges while the model moves fastest), then
    rounds of H, then ``late_rounds`` rounds of ``late_h`` (more frequent merges while the
    learning rate decays)."""
    for flag, rounds, h in (("early", early_rounds, early_h), ("late", late_rounds, late_h)):
        if rounds and h < 1:
            raise ValueError(f"--{flag}-h must be >= 1 with --{flag}-rounds, got {h}")
    early, late = early_rounds * early_h, late_rounds * late_h
    if early + late > T or (T - early - late) % H:
        raise ValueError(
            f"{early_rounds} early rounds of {early_h} steps and {late_rounds} late rounds of "
            f"{late_h} leave {T - early - late} of {T} steps, not a whole number of rounds of "
            f"H={H}"
        )
    return [early_h] * early_rounds + [H] * ((T - early - late) // H) + [late_h] * late_rounds


def epochs_of(space: BlockSpace, windows: int) -> float:
    """How many passes over the data ``windows`` trained windows are."""
    return windows / space.n_windows


def as_ranges(windows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of window indices as [start, stop) ranges, in order."""
    ranges: list[tuple[int, int]] = []
    for w in windows:
        if ranges and ranges[-1][1] == w:
            ranges[-1] = (ranges[-1][0], w + 1)
        else:
            ranges.append((w, w + 1))
    return ranges


def interleave(leases: list[list[int]], batch: int) -> list[int]:
    """The centralised order: step h takes every site's step-h windows together."""
    steps = len(leases[0]) // batch
    return [w for h in range(steps) for lease in leases for w in lease[h * batch : (h + 1) * batch]]


class Run:
    """One variant: a global model, per-site inner optimisers, the outer state."""

    def __init__(self, name, store, vocab, seed, schedule, outer, sites, inner,
                 wire: Wire = WORKFLOW_WIRE, flavour: str = "tiny") -> None:  # fmt: skip
        self.name, self.store, self.schedule, self.outer = name, store, schedule, outer
        self.wire = wire
        self.model = build_model(flavour, vocab_size=vocab, seed=seed)
        self.master = {k: v.detach().clone().float() for k, v in parameters_of(self.model).items()}
        self.momentum: dict[str, torch.Tensor] = {}
        self.inner = inner
        #: sites' AdamW denominators estimate a batch of this many sites' (1: AdamW's own)
        self.combined = 1
        self.optimizers = [self.new_optimizer() for _ in range(sites)]
        self.global_step = 0
        self.train_s = 0.0
        #: what happens to the sites' AdamW state at a merge (the workflow keeps it), and at
        #: every how many merges
        self.adam_state, self.adam_every = "shared", 1
        #: the merged second-moment factors a site adopts with the merged model (``shared``)
        self.merged_moments: dict[str, torch.Tensor] = {}
        self.merges = 0
        #: how the outer step weights the embedding's rows (``outer.embedding_rows``)
        self.embedding_rows = rowcounts.DEFAULT_MODE
        #: the (eta, beta) each outer step ran with, by number of contributors
        self.steps_run: dict[int, tuple[float, float]] = {}
        #: ``--outer-decay``: the outer rate's floor (a cosine over the run), None: constant
        self.outer_decay: float | None = None

    def merge(
        self,
        deltas: list[dict[str, torch.Tensor]],
        tokens: list[int],
        leases: list[list[int]],
    ) -> None:
        """The outer step (the embedding's rows weighted by the sites' token counts in
        ``leases``, with ``counts``), then the sites' AdamW state as ``adam_state`` says."""
        rows = None
        if self.embedding_rows == rowcounts.COUNTS and len(deltas) > 1:
            vocab = self.store.vocab_size
            counts = [rowcounts.token_counts(self.store.take(lease), vocab) for lease in leases]
            weights = rowcounts.row_weights(counts, token_shares(tokens))
            rows = {rowcounts.EMBEDDING: weights} if weights is not None else None
        outer = self.outer
        if self.outer_decay is not None:
            outer = decayed_outer(outer, token_shares(tokens), self.outer_factor())
        report = outer_step(self.master, self.momentum, deltas, tokens, outer, row_weights=rows)
        self.steps_run[report.contributors] = (report.eta_used, report.beta_used)
        self.merges += 1
        if self.merges % self.adam_every:
            return
        if self.adam_state == "reset":
            self.optimizers = [self.new_optimizer() for _ in deltas]
        elif self.adam_state in ADAM_AVERAGES and len(self.optimizers) > 1:
            average_adam_state(self.optimizers, ADAM_AVERAGES[self.adam_state])
        elif self.adam_state == "shared":  # each site adopts them with the merged model
            params = parameters_of(self.model)
            sent = [moments.state_factors(params, opt) for opt in self.optimizers]
            self.merged_moments = moments.merge(sent, tokens)

    def new_optimizer(self) -> torch.optim.Optimizer:
        """A site's inner optimiser: the workflow's AdamW, or ``CombinedAdamW``."""
        if self.combined > 1:
            return combined_optimizer(self.model, self.inner, self.combined)
        return make_optimizer(self.model, self.inner, lr=0.0)

    def outer_factor(self) -> float:
        """``--outer-decay``'s factor on the outer rate at this merge: the inner schedule's
        cosine after its warmup, from 1 to the floor, at the round's last step (the merge
        comes after the round's steps are counted)."""
        cosine = replace(self.schedule, peak_lr=1.0, min_lr_factor=self.outer_decay)
        return cosine.lr_at(max(self.global_step - 1, self.schedule.warmup_steps))

    def round(self, leases: list[list[int]], steps: int) -> None:
        """Every site trains its lease from the global model; the outer step merges."""
        t0 = time.perf_counter()
        deltas, tokens = [], []
        published = self.published()
        for i, lease in enumerate(leases):
            load_parameters(self.model, published)
            self.adopt_moments(i)
            optimizer = self.optimizers[i]
            trainer = Trainer(self.model, optimizer, self.inner)
            state = run_inner_phase(
                trainer,
                self.store.windows,
                LeaseWindows.of(as_ranges(lease)),
                schedule=self.schedule,
                global_step=self.global_step,
            )
            deltas.append(delta_of(parameters_of(self.model), published, self.wire.delta_dtype))
            tokens.append(state.tokens)
        self.global_step += steps
        if self.outer is None:  # centralised: the model simply continues
            self.master = {k: v.detach().clone() for k, v in parameters_of(self.model).items()}
        else:
            self.merge(deltas, tokens, leases)
        self.train_s += time.perf_counter() - t0

    def adopt_moments(self, site: int) -> None:
        """Site ``site`` rescales its AdamW second moment to the merged factors, as a site of
        the workflow does when it adopts a merged model (``inner.second_moment: shared``)."""
        if self.merged_moments:
            moments.adopt(parameters_of(self.model), self.optimizers[site], self.merged_moments)

    def published(self) -> dict[str, torch.Tensor]:
        """A copy of the global model the sites download: the fp32 master in the wire's
        global dtype (centralised training has no wire: its model simply continues)."""
        if self.outer is None:
            return self.master
        return {k: v.to(self.wire.global_dtype, copy=True) for k, v in self.master.items()}

    def perplexity(self, val: WindowStore, max_windows: int) -> float:
        load_parameters(self.model, self.master)
        _, ppl = evaluate(self.model, val.windows, val.n_windows, max_windows=max_windows)
        return ppl


class CombinedAdamW(torch.optim.Optimizer):
    """AdamW whose denominator estimates the second moment of a gradient over ``sites``
    sites' batches rather than one's (``--combined-denominator``, a lever measured here):
    sqrt(m^2 + (v - m^2) / sites) for bias-corrected m and v, m^2 standing for the squared
    mean gradient and v - m^2 for one batch's noise, which ``sites`` batches divide. With
    ``sites`` 1 it is torch's AdamW (``tests/unit/test_quality_bench.py``). The state keys are
    torch's, so the shared second moment and the averages apply to it as they are."""

    def __init__(self, groups, lr: float, betas: tuple[float, float], sites: float,
                 eps: float = 1e-8) -> None:  # fmt: skip
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.sites = float(sites)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                p.mul_(1 - lr * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = state["exp_avg"] / (1 - b1**t)
                v = state["exp_avg_sq"] / (1 - b2**t)
                signal = torch.minimum(m * m, v)
                denom = (signal + (v - signal) / self.sites).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr)


def combined_optimizer(model: torch.nn.Module, inner: InnerConfig, sites: int) -> CombinedAdamW:
    """``make_optimizer``'s groups (decay on matrices only) under :class:`CombinedAdamW`."""
    groups = decay_groups(model, inner.weight_decay)
    return CombinedAdamW(groups, lr=0.0, betas=inner.betas, sites=sites)


def average_adam_state(
    optimizers: list[torch.optim.Optimizer], keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
) -> None:
    """Every optimiser's AdamW moments ``keys`` become their mean over the optimisers, whole
    (a lever the bench measures; the workflow shares the second moment's factors)."""
    for p in optimizers[0].state:
        for key in keys:
            mean = torch.stack([opt.state[p][key] for opt in optimizers]).mean(0)
            for opt in optimizers:
                opt.state[p][key].copy_(mean)


class OverlapRun(Run):
    """The DiLoCo row with overlapped rounds: every site keeps its own weights across rounds.

    ``tau`` is how many steps into a round's phase the previous round's merged model (the
    master) arrives; the first round is plain.
    """

    def __init__(self, name, store, vocab, seed, schedule, outer, sites, inner,
                 overlap: OverlapConfig, tau: int, wire: Wire = WORKFLOW_WIRE,
                 flavour: str = "tiny") -> None:  # fmt: skip
        super().__init__(name, store, vocab, seed, schedule, outer, sites, inner, wire, flavour)
        self.overlap, self.tau = overlap, tau
        #: each site's weights when it sent its last delta (None before its first round)
        self.sent: list[dict[str, torch.Tensor] | None] = [None] * sites
        #: ``--overlap-eager``: the stale steps start from an estimate of the coming merge
        self.eager = False
        #: the global model the round before this one published, and each site's delta of
        #: the round before its last (what the eager estimate needs)
        self.before: dict[str, torch.Tensor] | None = None
        self.previous: dict[str, torch.Tensor] | None = None
        self.older_delta: list[dict[str, torch.Tensor] | None] = [None] * sites
        self.last_delta: list[dict[str, torch.Tensor] | None] = [None] * sites
        #: ``--overlap-counts all``: the embedding rows' counts take the stale steps' windows
        #: too, not only those after the fold-in (the workflow's ``PhaseState.counted_from``)
        self.count_stale = False
        #: ``--overlap-embedding merged``: the fold-in keeps the stale steps' update of every
        #: tensor but the token embedding, which it sets to the merged model's (a diagnostic of
        #: where the stale steps' cost lies; those steps' windows then train no embedding row)
        self.stale_embedding = "rebase"

    def eager_start(self, site: int) -> dict[str, torch.Tensor]:
        """Where site ``site`` takes its stale steps from with ``--overlap-eager`` (Kale et
        al. 2025's eager update, for a fold-in part way through the phase): not its own
        weights (the last published model ``P``, ``previous``, plus its whole delta ``d``) but
        the coming merge as it can estimate it: ``P + d / S`` for its own share, plus the
        other sites' share of the last merge, ``(P - P_before) - d_before / S``. Its own
        weights until it has that."""
        sent, own, older = self.sent[site], self.last_delta[site], self.older_delta[site]
        if self.previous is None or self.before is None or own is None or older is None:
            return sent
        S = len(self.optimizers)
        return {
            k: (p.float() + (own[k].float() - older[k].float()) / S
                + (p.float() - self.before[k].float()))
            for k, p in self.previous.items()
        }  # fmt: skip

    def round(self, leases: list[list[int]], steps: int) -> None:
        """Each site: tau steps from its own weights, fold in the master, the rest; merge
        (the embedding's rows weighted, with ``counts``, by the windows after the fold-in)."""
        t0 = time.perf_counter()
        deltas, tokens, counted = [], [], []
        merged = self.published()
        for i, lease in enumerate(leases):
            trainer = Trainer(self.model, self.optimizers[i], self.inner)
            sent = self.sent[i]
            state, stale = PhaseState(), 0
            if sent is None:  # the first round: nothing in flight, train from the global model
                load_parameters(self.model, merged)
                self.adopt_moments(i)
            else:
                if self.eager:
                    sent = self.eager_start(i)
                load_parameters(self.model, sent)
                stale = min(self.tau, steps) * self.inner.windows_per_step
                if stale:
                    state = self._phase(trainer, lease[:stale], state)
                theta = fold_in(parameters_of(self.model), sent, merged, self.overlap)
                if self.stale_embedding == "merged":
                    theta[rowcounts.EMBEDDING] = merged[rowcounts.EMBEDDING].float()
                load_parameters(self.model, theta)
                self.adopt_moments(i)
            state = self._phase(trainer, lease, state)
            ended = {k: v.detach().clone() for k, v in parameters_of(self.model).items()}
            deltas.append(delta_of(ended, merged, self.wire.delta_dtype))
            tokens.append(state.tokens)
            # the workflow's PhaseState.counted_from, or every window with count_stale
            counted.append(lease if self.count_stale else lease[stale:])
            self.sent[i] = ended
            self.older_delta[i], self.last_delta[i] = self.last_delta[i], deltas[-1]
        self.before, self.previous = self.previous, merged
        self.global_step += steps
        self.merge(deltas, tokens, counted)
        self.train_s += time.perf_counter() - t0

    def _phase(self, trainer: Trainer, lease: list[int], state: PhaseState) -> PhaseState:
        """The lease's steps from ``state``'s cursor on, the schedule at the global step."""
        return run_inner_phase(
            trainer,
            self.store.windows,
            LeaseWindows.of(as_ranges(lease)),
            schedule=self.schedule,
            global_step=self.global_step,
            state=state,
        )


def regime_steps(regime: str, inner_steps: list[int] | None,
                 steps: list[int] | None) -> dict[int, int]:  # fmt: skip
    """H -> optimiser steps T: the regime's, or ``steps`` (one value, or one per H)."""
    table = REGIMES[regime]
    hs = inner_steps or list(table)
    if steps is None:
        missing = [H for H in hs if H not in table]
        if missing:
            raise ValueError(f"--inner-steps {missing} is not in the {regime} regime "
                             f"({sorted(table)}): give --steps")  # fmt: skip
        ts = [table[H] for H in hs]
    elif len(steps) == 1:
        ts = steps * len(hs)
    elif len(steps) == len(hs):
        ts = steps
    else:
        raise ValueError(f"--steps takes one value or one per H ({len(hs)}), got {len(steps)}")
    for H, T in zip(hs, ts, strict=True):
        if H < 1 or T < 1 or T % H:
            raise ValueError(f"--steps {T} is not a whole number of rounds of H={H}")
    return dict(zip(hs, ts, strict=True))


def overlap_tau(fraction: float, H: int) -> int:
    """Steps into a round at which the merged model arrives: max(1, round(F * H)) capped at
    H; 0 for F = 0 (before the first step)."""
    if not fraction >= 0.0:
        raise ValueError(f"--overlap-delay must be >= 0 (a fraction of H), got {fraction}")
    return 0 if fraction == 0.0 else min(H, max(1, round(fraction * H)))


def overlap_name(S: int, config: OverlapConfig, tau: int, tag: str = "") -> str:
    """The overlap row's name, e.g. ``DiLoCo 3 sites, overlap (rebase, tau=2)``."""
    rule = config.rule if config.rule == "rebase" else f"{config.rule} alpha={config.alpha:g}"
    if config.rule == "rebase" and config.stale_weight != 1.0:
        rule += f", stale weight {config.stale_weight:g}"
    return f"DiLoCo {S} sites, overlap ({rule}, tau={tau}){tag}"


def parse_outer(text: str) -> tuple[str, OuterConfig]:
    """An outer-step setting: a preset name, or ``eta=E,beta=B[,solo=0|1]``."""
    if text in PRESETS:
        return text, PRESETS[text]
    fields = {"solo": "solo_full_step"}
    try:
        kwargs: dict[str, float | bool] = {}
        for part in text.split(","):
            key, value = part.split("=")
            name = fields.get(key.strip(), key.strip())
            kwargs[name] = bool(int(value)) if name == "solo_full_step" else float(value)
        return text, OuterConfig(**kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"--outer {text!r}: expected one of {sorted(PRESETS)} or eta=E,beta=B[,solo=0|1] "
            f"({exc})"
        ) from None


def outer_json(config: OuterConfig) -> dict:
    """The outer step a preset runs, as the JSON names it: only the settings it uses."""
    if config.preset == "average":
        eta, beta = AVERAGE_STEP
        return {"preset": "average", "eta": eta, "beta": beta}
    if config.preset == "tuned":
        return {"preset": "tuned", "eta": "1/sqrt(effective live sites)", "beta": TUNED_BETA}
    return {"preset": config.preset, "eta": config.eta, "beta": config.beta,
            "solo_full_step": config.solo_full_step}  # fmt: skip


def decayed_outer(outer: OuterConfig, shares: list[float], factor: float) -> OuterConfig:
    """The outer step ``outer`` takes for these contributors, its rate times ``factor``
    (``--outer-decay``), as an explicit eta and beta."""
    eta, beta = outer.step_for(shares)
    return OuterConfig(eta=eta * factor, beta=beta, solo_full_step=False, preset="paper")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def warmup_steps(args, T: int) -> int:
    """The runs' warmup over ``T`` steps: ``--warmup-steps``, else the workflow's default."""
    return default_warmup_steps(T) if args.warmup_steps is None else args.warmup_steps


def train_one(args, store, val, seed: int, H: int, variants: list[str], outers) -> dict:
    """One data order and model seed at one H: every requested row, trained side by side."""
    S, B, T = args.sites, args.batch, args.steps_by_h[H]
    lengths = round_lengths(H, T, args.early_rounds, args.early_h, args.late_rounds,
                            args.late_h)  # fmt: skip
    R = len(lengths)
    space = BlockSpace(store.n_windows, args.block_size, seed=1234 + seed)
    plan = site_windows(space, S, B, lengths, R)
    schedule = LRSchedule(
        peak_lr=args.lr,
        warmup_steps=warmup_steps(args, T),
        total_steps=T,
        min_lr_factor=args.min_lr_factor,
    )
    wire = Wire(DTYPES[args.global_dtype], DTYPES[args.delta_dtype])
    site_cfg = InnerConfig(micro_batch=B, weight_decay=args.weight_decay)
    # the combined per-step batch
    wide_cfg = InnerConfig(micro_batch=B, accumulation=S, weight_decay=args.weight_decay)
    fedavg = OuterConfig(eta=1.0, beta=0.0)
    vocab, flavour = store.vocab_size, args.flavour
    runs: dict[str, Run] = {}
    if "centralised" in variants:
        runs["centralised"] = Run("centralised", store, vocab, seed, schedule, None, 1, wide_cfg,
                                 flavour=flavour)  # fmt: skip
    for label, outer in outers:
        tag = "" if len(outers) == 1 else f" [{label}]"
        if "diloco" in variants:
            runs[f"DiLoCo {S} sites{tag}"] = Run("diloco", store, vocab, seed, schedule, outer,
                                                 S, site_cfg, wire, flavour)  # fmt: skip
        if "solo" in variants:
            runs[f"DiLoCo 1 site{tag}"] = Run("solo", store, vocab, seed, schedule, outer, 1,
                                              wide_cfg, wire, flavour)  # fmt: skip
        if "overlap" in variants:
            config, tau = overlap_config(args), overlap_tau(args.overlap_delay, H)
            runs[overlap_name(S, config, tau, tag)] = OverlapRun(
                "overlap", store, vocab, seed, schedule, outer, S, site_cfg, config, tau, wire,
                flavour,
            )  # fmt: skip
    if "fedavg" in variants:  # the average preset is FedAvg: one run serves both rows
        runs[FEDAVG] = next(
            (r for r in runs.values() if r.name == "diloco" and r.outer.preset == "average"),
            None,
        ) or Run("fedavg", store, vocab, seed, schedule, fedavg, S, site_cfg, wire, flavour)
    if "floor" in variants:  # centralised training up to fp32 rounding: the noise floor
        runs[FLOOR] = Run("floor", store, vocab, seed, schedule, fedavg, 1, wide_cfg, LOSSLESS,
                          flavour)  # fmt: skip
    unique = list({id(run): run for run in runs.values()}.values())
    for run in unique:
        if isinstance(run, OverlapRun):
            run.eager = args.overlap_eager
            run.count_stale = args.overlap_counts == "all"
            run.stale_embedding = args.overlap_embedding
        run.adam_state, run.adam_every = args.adam_state, args.adam_every
        run.outer_decay = args.outer_decay
        run.embedding_rows = args.embedding_rows
        if args.combined_denominator and len(run.optimizers) > 1:
            run.combined = len(run.optimizers)
            run.optimizers = [run.new_optimizer() for _ in run.optimizers]
    curves: dict[str, list[float]] = {name: [] for name in runs}
    every = args.eval_every or T
    step = 0
    for r, length in enumerate(lengths):
        leases = plan[r]
        together = [interleave(leases, B)]
        for run in unique:
            run.round(together if len(run.optimizers) == 1 else leases, length)
        evaluated, step = step // every, step + length
        if step // every > evaluated or r == R - 1:
            for name, run in runs.items():
                curves[name].append(run.perplexity(val, args.eval_windows))
            print(
                f"seed {seed} H={H} round {r + 1}/{R} (step {step}): "
                + ", ".join(f"{n} {c[-1]:.1f}" for n, c in curves.items()),
                flush=True,
            )
    return {
        "final": {name: c[-1] for name, c in curves.items()},
        "curves": {name: [round(p, 2) for p in c] for name, c in curves.items()},
        "train_s": {name: round(run.train_s, 1) for name, run in runs.items()},
        "outer_run": {
            name: {str(n): list(step) for n, step in sorted(run.steps_run.items())}
            for name, run in runs.items()
            if run.steps_run
        },  # fmt: skip
        "epochs": round(epochs_of(space, T * S * B), 3),
    }


def overlap_config(args) -> OverlapConfig:
    """The overlap row's fold-in rule from the command line."""
    return OverlapConfig(
        enabled=True,
        rule=args.overlap_rule,
        alpha=args.overlap_alpha,
        stale_weight=args.overlap_stale_weight,
    )


def train_cell(args, data: Path, seed: int, H: int, outers) -> dict:
    """:func:`train_one` in a worker process (``--jobs``): its own data handles and threads."""
    torch.set_num_threads(args.threads)
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    return train_one(args, store, val, seed, H, args.variants, outers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a prepared data directory (default: build one)")
    parser.add_argument("--flavour", choices=sorted(LOCAL_FLAVOURS), default="tiny",
                        help="the model: crossfed's CPU flavours (tiny: 1.05 M parameters, "
                        "small: 5.2 M at the bench's vocabulary)")  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="B per site per step")
    parser.add_argument("--block-size", type=int, default=16,
                        help="K consecutive windows of the corpus per DARL block")  # fmt: skip
    parser.add_argument("--regime", choices=REGIMES, default="long",
                        help="long: the workflow's H=25 (40 rounds) and the paper's H=100 (20 "
                        "rounds), about an hour on 2 cores; short: H=3 and 5 over 150 steps, "
                        "minutes")  # fmt: skip
    parser.add_argument(
        "--inner-steps",
        type=int,
        nargs="+",
        help="H values, each its own set of runs (default: the regime's)",
    )
    parser.add_argument("--steps", type=int, nargs="+",
                        help="optimiser steps T of every run (R = T / H rounds): one value, or "
                        "one per H (default: the regime's for its H)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="model seed s and data order 1234 + s")  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--outer", nargs="+", type=parse_outer,
                        default=[parse_outer(DEFAULT_PRESET)],
                        help=f"outer step(s) of the DiLoCo rows: {sorted(PRESETS)} or "
                        "eta=E,beta=B[,solo=0|1]; the first one is the JSON's")  # fmt: skip
    parser.add_argument("--overlap-delay", type=float, default=0.25,
                        help="the overlap row's tau as a fraction F of H: max(1, round(F*H)), "
                        "at most H; 0: the merged model arrives before the first step")  # fmt: skip
    parser.add_argument("--overlap-rule", choices=RULES, default="rebase",
                        help="how the overlap row folds in the merged model")  # fmt: skip
    parser.add_argument("--overlap-alpha", type=float, default=0.5,
                        help="the site's weight in the mix rule (Streaming DiLoCo)")  # fmt: skip
    parser.add_argument("--overlap-stale-weight", type=float,
                        default=OverlapConfig().stale_weight,
                        help="with rebase: the weight the fold-in keeps the stale steps with "
                        "(the workflow's overlap.stale_weight; 0 drops their update)")  # fmt: skip
    parser.add_argument("--overlap-eager", action="store_true",
                        help="with rebase: the stale steps start from the site's estimate of "
                        "the coming merge (its own delta's share plus the other sites' share "
                        "of the last merge), not from its own weights")  # fmt: skip
    parser.add_argument("--overlap-counts", choices=("after-fold-in", "all"),
                        default="after-fold-in",
                        help="with --embedding-rows counts: the overlap row counts the windows "
                        "after its fold-in (the workflow's) or all of its phase's, the stale "
                        "steps' too")  # fmt: skip
    parser.add_argument("--overlap-embedding", choices=("rebase", "merged"), default="rebase",
                        help="the overlap row's fold-in for the token embedding: rebase it as "
                        "every tensor (the workflow's) or take the merged model's, dropping the "
                        "stale steps' update of it (a diagnostic)")  # fmt: skip
    parser.add_argument("--global-dtype", choices=DTYPES, default="bf16",
                        help="the global model sites download (the workflow's: bf16)")  # fmt: skip
    parser.add_argument("--delta-dtype", choices=DTYPES, default="bf16",
                        help="the deltas sites send (the workflow's: bf16)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warmup steps (default: the workflow's for a new run, "
                        "a tenth of the run's steps: schedule.default_warmup_steps)")  # fmt: skip
    parser.add_argument("--min-lr-factor", type=float, default=DEFAULT_MIN_LR_FACTOR,
                        help="the cosine's floor as a share of the peak (default: the "
                        "workflow's for a new run, schedule.DEFAULT_MIN_LR_FACTOR)")  # fmt: skip
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="AdamW weight decay on matrices (inner.weight_decay)",
    )
    parser.add_argument(
        "--adam-state",
        choices=ADAM_STATES,
        default="shared",
        help="the sites' AdamW state at a merge: shared (the workflow's default: the second "
        "moment's row and column factors averaged, crossfed.moments), keep (each site's "
        "own: inner.second_moment: own), reset, or average over the sites whole (both "
        "moments, or only m or v)",
    )
    parser.add_argument(
        "--embedding-rows",
        choices=rowcounts.MODES,
        default=rowcounts.DEFAULT_MODE,
        help="how the outer step weights the token embedding's rows: counts (the workflow's "
        "default: by how often each site saw each token, crossfed.rowcounts; "
        "outer.embedding_rows) or shares (by the token shares, as every other tensor)",
    )
    parser.add_argument(
        "--combined-denominator", action="store_true",
        help="each site of a several-site row divides by sqrt(m^2 + (v - m^2) / S), an estimate "
        "of the second moment over the S sites' batches (CombinedAdamW), not by sqrt(v)",
    )  # fmt: skip
    parser.add_argument("--adam-every", type=int, default=1,
                        help="apply --adam-state at every K-th merge (default: each)")  # fmt: skip
    parser.add_argument("--early-rounds", type=int, default=0,
                        help="the first this many rounds merge every --early-h steps, the rest "
                        "every H (the total steps unchanged)")  # fmt: skip
    parser.add_argument("--early-h", type=int, default=0, help="inner steps of an early round")
    parser.add_argument("--late-rounds", type=int, default=0,
                        help="the last this many rounds merge every --late-h steps (the total "
                        "steps unchanged)")  # fmt: skip
    parser.add_argument("--late-h", type=int, default=0, help="inner steps of a late round")
    parser.add_argument(
        "--outer-decay", type=float, default=None, metavar="FLOOR",
        help="the outer rate follows the inner schedule's cosine after its warmup, from 1 to "
        "FLOOR x (with --min-lr-factor 1.0: the sites keep their rate, the merge anneals; "
        "default: a constant outer rate)",
    )  # fmt: skip
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every this many steps (0: at the end only)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--jobs", type=int, default=1,
                        help="train the (H, seed) cells in this many processes")  # fmt: skip
    args = parser.parse_args()
    if args.adam_every < 1:
        parser.error(f"--adam-every must be a positive number of merges, got {args.adam_every}")
    if args.overlap_eager and args.overlap_rule != "rebase":
        parser.error(f"--overlap-eager rebases the stale steps; --overlap-rule {args.overlap_rule}")
    if args.overlap_stale_weight != 1.0 and args.overlap_rule != "rebase":
        parser.error("--overlap-stale-weight weighs the rebased stale steps; "
                     f"--overlap-rule {args.overlap_rule}")  # fmt: skip
    try:
        overlap_config(args)  # its own checks (alpha, the stale weight) name the problem
    except OverlapConfigError as exc:
        parser.error(str(exc))
    try:
        args.steps_by_h = regime_steps(args.regime, args.inner_steps, args.steps)
    except ValueError as exc:
        parser.error(str(exc))
    args.inner_steps = list(args.steps_by_h)
    try:
        rounds_by_h = {
            H: len(
                round_lengths(H, T, args.early_rounds, args.early_h, args.late_rounds, args.late_h)
            )  # fmt: skip
            for H, T in args.steps_by_h.items()
        }
    except ValueError as exc:
        parser.error(str(exc))
    try:
        overlap = overlap_config(args)
        taus = {H: overlap_tau(args.overlap_delay, H) for H in args.inner_steps}
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    data = Path(args.data) if args.data else Path(tmp.name) / "data"
    if not args.data:
        prepare(data, vocab_size=args.vocab_size, seq_len=args.seq_len, val_fraction=0.05,
                shards=2, log=lambda *_: None)  # fmt: skip
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    S, B = args.sites, args.batch
    outers = args.outer
    cells = [(H, seed) for H in args.inner_steps for seed in args.seeds]
    if args.jobs > 1:  # each (H, seed) in its own process, one thread each
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {
                cell: pool.submit(train_cell, args, data, cell[1], cell[0], outers)
                for cell in cells
            }
            results = {cell: future.result() for cell, future in futures.items()}
    else:
        results = {
            (H, seed): train_one(args, store, val, seed, H, args.variants, outers)
            for H, seed in cells
        }
    tokens = {H: T * S * B * store.seq_len for H, T in args.steps_by_h.items()}
    lead = "" if len(outers) == 1 else f" [{outers[0][0]}]"
    diloco, solo = f"DiLoCo {S} sites{lead}", f"DiLoCo 1 site{lead}"
    overlapped = {H: overlap_name(S, overlap, taus[H], lead) for H in args.inner_steps}
    print()
    for H, T in args.steps_by_h.items():
        epochs = results[(H, args.seeds[0])]["epochs"]
        print(f"H={H}: {tokens[H]} tokens ({epochs:g} epochs) and {T} optimiser steps in every "
              f"run; seeds {args.seeds}")  # fmt: skip
    print("| H | rounds | run | held-out perplexity (mean ± sd) | vs centralised (mean ± sd) |")
    print("|---|---|---|---|---|")
    by_h: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {
        "ratio": [], "solo_over_centralised": [], "overlap_over_plain": []
    }  # fmt: skip
    per_h: dict[str, list[float]] = {}
    over_plain: dict[int, list[float]] = {}
    for H in args.inner_steps:
        finals = [results[(H, s)]["final"] for s in args.seeds]
        summary: dict[str, dict] = {}
        if diloco in finals[0] and overlapped[H] in finals[0]:
            over_plain[H] = [f[overlapped[H]] / f[diloco] for f in finals]
            ratios["overlap_over_plain"].extend(over_plain[H])
        for name in finals[0]:
            ppl = [f[name] for f in finals]
            rel = [f[name] / f["centralised"] for f in finals] if "centralised" in finals[0] else []
            m, sd = mean_std(ppl)
            cell = f"{mean_std(rel)[0]:.3f} ± {mean_std(rel)[1]:.3f}" if rel else "-"
            print(f"| {H} | {rounds_by_h[H]} | {name} | {m:.1f} ± {sd:.1f} | {cell} |")
            summary[name] = {"mean": round(m, 3), "sd": round(sd, 3),
                             "seeds": [round(p, 3) for p in ppl]}  # fmt: skip
            if rel:
                summary[name]["vs_centralised"] = round(mean_std(rel)[0], 4)
                summary[name]["vs_centralised_sd"] = round(mean_std(rel)[1], 4)
                if name == diloco:
                    ratios["ratio"].extend(rel)
                    per_h[f"ratio_h{H}"] = rel
                if name == solo:
                    ratios["solo_over_centralised"].extend(rel)
                    per_h[f"solo_h{H}"] = rel
                if name == FLOOR:
                    per_h[f"floor_h{H}"] = rel
        if H in over_plain:
            summary[overlapped[H]]["over_plain"] = round(mean_std(over_plain[H])[0], 4)
            summary[overlapped[H]]["over_plain_sd"] = round(mean_std(over_plain[H])[1], 4)
        by_h[str(H)] = summary
    if over_plain:
        print()
        print(f"| H | rounds | tau | overlap ({overlap.rule}) / {diloco}, perplexity (mean ± sd) |")
        print("|---|---|---|---|")
        for H, values in over_plain.items():
            m, sd = mean_std(values)
            print(f"| {H} | {rounds_by_h[H]} | {taus[H]} | {m:.4f} ± {sd:.4f} |")
    result = {
        "benchmark": "quality",
        "model": args.flavour,
        "sites": S,
        "batch_per_site": B,
        "block_size": args.block_size,
        "regime": args.regime,
        "inner_steps": args.inner_steps,
        "optimiser_steps": {str(H): T for H, T in args.steps_by_h.items()},
        "tokens": {str(H): n for H, n in tokens.items()},
        "epochs": {str(H): results[(H, args.seeds[0])]["epochs"] for H in args.inner_steps},
        "seeds": args.seeds,
        "outer": {label: outer_json(cfg) for label, cfg in outers},
        "wire": {"global": args.global_dtype, "delta": args.delta_dtype},
        "warmup_steps": {str(H): warmup_steps(args, T) for H, T in args.steps_by_h.items()},
        "min_lr_factor": args.min_lr_factor,
        "outer_decay": args.outer_decay,
        "weight_decay": args.weight_decay,
        "adam_state": args.adam_state,
        "embedding_rows": args.embedding_rows,
        "combined_denominator": args.combined_denominator,
        "early_rounds": args.early_rounds,
        "early_h": args.early_h,
        "late_rounds": args.late_rounds,
        "late_h": args.late_h,
        "rounds": {str(H): n for H, n in rounds_by_h.items()},
        "outer_run": results[cells[0]]["outer_run"],
        "by_h": by_h,
        "curves": {f"H={H} seed={s}": v["curves"] for (H, s), v in results.items()},
        "train_s": {f"H={H} seed={s}": v["train_s"] for (H, s), v in results.items()},
        "paper_diloco_over_centralised": round(PAPER_RATIO, 4),
    }
    if "overlap" in args.variants:
        result["overlap"] = {
            "rule": overlap.rule,
            "alpha": overlap.alpha,
            "stale_weight": overlap.stale_weight,
            "delay_fraction": args.overlap_delay,
            "eager": args.overlap_eager,
            "tau": {str(H): tau for H, tau in taus.items()},
        }
    for key, values in ratios.items():  # mean over seeds and H values
        result[key] = round(mean_std(values)[0], 4) if values else None
    for key, values in per_h.items():  # mean over seeds at one H
        result[key] = round(mean_std(values)[0], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
