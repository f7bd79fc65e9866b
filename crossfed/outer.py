"""Elastic token-weighted Nesterov outer step (paper Eq. 1, section 3.1).

Sites send deltas ``Δ_i = θ_i − w`` with the token counts ``n_i`` they consumed. With shares
``p_i = n_i / Σ n`` the pseudo-gradient is ``g = −Σ p_i Δ_i`` and the step is exactly
``torch.optim.SGD(lr=η, momentum=β, nesterov=True, dampening=0)`` applied to ``g``::

    b ← β b + g          (b = g on the first step, as torch does)
    w ← w − η (g + β b)

``β=0, η=1`` is FedAvg: ``w + Σ p_i Δ_i`` is the token-weighted mean of the site models.
Zero contributors is a no-op and one contributor takes the full step (``η=1``); both are
normal states of an elastic run. Which ``η`` and ``β`` a round uses is the config's preset
(:mod:`crossfed.outer_presets`): ``average`` (the default for a new run: ``η=1, β=0`` for
any number of live sites, the token-weighted mean of the site models), ``paper`` (η, β as
given) or ``tuned`` (β=0 and ``η = 1/sqrt(M)`` for ``M`` effective live sites; the default
before ``average``, kept for the runs made with it).

The merge streams: each delta tensor is read once, master and momentum are updated in place,
and no full-size fp32 temporary is made. Two kernels do the arithmetic: ``eager`` runs a few
in-place torch ops per cache-sized block; ``fused`` is the same expression compiled by
``torch.compile`` into one loop that touches each byte once (memory-bandwidth bound), used for
large models when a C++ compiler is available.

:func:`outer_step` works on tensors in memory; :func:`stream_outer_step` runs the same
per-tensor arithmetic for state that lives in files (the coordinator's): it reads each
master, momentum and delta tensor when its turn comes and hands the new tensors to a sink,
so a merge holds a few tensors at a time, never the model.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from crossfed.outer_presets import OuterConfig

log = logging.getLogger(__name__)

DELTA_DTYPES = (torch.bfloat16, torch.float32)
Kernel = Literal["auto", "eager", "fused"]

# Elements per eager block (16 MiB of fp32): the block's working set stays in cache across the
# handful of ops run over it. Smaller blocks fit L2 better, but every op is an OpenMP parallel
# region, and on a busy machine the per-region barrier costs more than the misses saved.
_EAGER_BLOCK = 1 << 22
# "auto" compiles the fused kernel only for models at least this large; below it the one-off
# compile (seconds) costs more than it saves.
_FUSED_MIN_PARAMS = 1 << 24
# Tensors smaller than this go through the eager kernel even when the fused one is in use.
_FUSED_MIN_NUMEL = 1 << 12
# The fused kernel takes deltas in groups of this many (padded with zero-share copies), so one
# compiled kernel serves every round of up to this many contributors.
_FUSED_ARITY = 4
# More contributors than this use the eager kernel (each arity is one more compiled variant).
_FUSED_MAX_CONTRIBUTORS = 4 * _FUSED_ARITY


class DeltaError(ValueError):
    """A site delta that cannot enter the average; the message names the tensor and problem."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class StateError(ValueError):
    """The master or momentum handed to :func:`outer_step` is not usable."""


@dataclass
class OuterStepReport:
    """What one outer step did."""

    contributors: int
    eta_used: float
    tokens: int
    beta_used: float = 0.0
    shares: list[float] = field(default_factory=list)
    applied: bool = False


def _token_counts(tokens: Sequence[int]) -> list[int]:
    counts = []
    for i, n in enumerate(tokens):
        if isinstance(n, bool):
            raise ValueError(f"token count #{i} is a bool ({n!r}), not an integer")
        try:
            count = operator.index(n)
        except TypeError:
            raise ValueError(f"token count #{i} is not an integer: {n!r}") from None
        if count < 0:
            raise ValueError(f"token count #{i} is negative: {count}")
        counts.append(count)
    return counts


def token_shares(tokens: Sequence[int]) -> list[float]:
    """Token shares ``p_i = n_i / Σ n``; ValueError on empty, negative or zero-sum counts."""
    counts = _token_counts(tokens)
    if not counts:
        raise ValueError("token shares need at least one token count")
    total = sum(counts)
    if total == 0:
        raise ValueError(f"token counts sum to zero: {counts}")
    return [n / total for n in counts]


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_keys(reference: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> None:
    keys = list(delta.keys())
    have = set(keys)
    missing = [name for name in reference.keys() if name not in have]
    if missing:
        raise DeltaError(f"delta is missing tensor(s) {_names(missing)}", missing[0])
    extra = sorted(have.difference(reference.keys()))
    if extra:
        raise DeltaError(f"delta has unexpected tensor(s) {_names(extra)}", extra[0])


def _check_meta(name: str, reference: Tensor, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise DeltaError(
            f"delta tensor {name!r} is a {type(value).__name__}, not a torch.Tensor", name
        )
    if value.dtype not in DELTA_DTYPES:
        raise DeltaError(
            f"delta tensor {name!r} has dtype {value.dtype}; expected bfloat16 or float32", name
        )
    if value.shape != reference.shape:
        raise DeltaError(
            f"delta tensor {name!r} has shape {tuple(value.shape)}; "
            f"expected {tuple(reference.shape)}",
            name,
        )
    return value


def validate_delta(reference: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> None:
    """Check a delta against the master: same keys and shapes, bf16/fp32, all values finite.

    Reads each tensor of ``delta`` once; raises :class:`DeltaError` naming the first bad tensor.
    Run it when a delta arrives: :func:`outer_step` relies on it for finiteness.
    """
    _check_keys(reference, delta)
    for name, ref in reference.items():
        value = _check_meta(name, ref, delta[name])
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            raise DeltaError(
                f"delta tensor {name!r} has {bad} non-finite value(s) (NaN or Inf)", name
            )


def _check_state(master: Mapping[str, Tensor], momentum: Mapping[str, Tensor]) -> None:
    for name, w in master.items():
        if not isinstance(w, Tensor) or w.dtype != torch.float32 or not w.is_contiguous():
            raise StateError(f"master tensor {name!r} must be a contiguous float32 tensor")
    if not momentum:
        return
    if set(momentum.keys()) != set(master.keys()):
        missing = sorted(set(master.keys()).difference(momentum.keys()))
        extra = sorted(set(momentum.keys()).difference(master.keys()))
        raise StateError(
            "momentum must be empty or hold exactly the master's tensors; "
            f"missing {_names(missing) or 'none'}, unexpected {_names(extra) or 'none'}"
        )
    for name, w in master.items():
        b = momentum[name]
        if (
            not isinstance(b, Tensor)
            or b.dtype != torch.float32
            or not b.is_contiguous()
            or b.shape != w.shape
            or b.device != w.device
        ):
            raise StateError(
                f"momentum tensor {name!r} must be a contiguous float32 tensor shaped like the "
                f"master's {tuple(w.shape)}"
            )


def _merge_eager(
    w: Tensor,
    b: Tensor,
    ds: list[Tensor],
    ps: list[float],
    beta: float,
    eta: float,
    fresh: bool,
    scratch: tuple[Tensor, Tensor],
) -> None:
    """Blocked in-place merge; the same torch ops (and rounding) as SGD's Nesterov step."""
    wf, bf = w.view(-1), b.view(-1)
    flat = [d.reshape(-1) for d in ds]
    n = wf.numel()
    for lo in range(0, n, _EAGER_BLOCK):
        hi = min(lo + _EAGER_BLOCK, n)
        s, tmp = scratch[0][: hi - lo], scratch[1][: hi - lo]
        s.copy_(flat[0][lo:hi])  # s = Σ p_i Δ_i, converted to fp32 block by block
        if ps[0] != 1.0:
            s.mul_(ps[0])
        for d, p in zip(flat[1:], ps[1:], strict=True):
            src = d[lo:hi]
            if src.dtype != torch.float32:
                src = tmp.copy_(src)
            s.add_(src, alpha=p)
        bb = bf[lo:hi]
        if fresh:
            torch.neg(s, out=bb)  # b = g
        else:
            bb.mul_(beta).sub_(s)  # b = β b + g
        s.add_(bb, alpha=-beta)  # s − β b = −(g + β b)
        wf[lo:hi].add_(s, alpha=eta)  # w − η (g + β b)


def _fused_body(w: Tensor, b: Tensor, coef: Tensor, *ds: Tensor) -> None:
    """One pass: ``coef`` holds the shares, then beta, then eta (fp32, so no recompiles)."""
    k = len(ds)
    s = ds[0].float() * coef[0]
    for i in range(1, k):
        s = s + ds[i].float() * coef[i]
    beta, eta = coef[k], coef[k + 1]
    bn = b * beta - s
    b.copy_(bn)
    w.copy_(w - eta * (beta * bn - s))


_fused_lock = threading.Lock()
_fused_fn: Callable[..., None] | None = None
_fused_widths: set[int] = set()
_fused_failed: str | None = None


def _width(contributors: int) -> int:
    return _FUSED_ARITY * math.ceil(contributors / _FUSED_ARITY)


def _get_fused(width: int) -> Callable[..., None]:
    """The fused kernel, compiled for ``width`` deltas (raises if this machine cannot compile).

    Compiling happens here, on small dummy tensors, so that a failure surfaces before any
    tensor of the model is written.
    """
    global _fused_fn, _fused_failed
    with _fused_lock:
        if _fused_fn is not None and width in _fused_widths:
            return _fused_fn
        if _fused_failed is not None:
            raise RuntimeError(_fused_failed)
        try:
            if _fused_fn is None:
                # dynamic_threads: the OpenMP loop is parallel whatever size the warm-up had.
                _fused_fn = torch.compile(
                    _fused_body,
                    dynamic=True,
                    fullgraph=True,
                    options={"cpp.dynamic_threads": True},
                )
            n = 2 * _FUSED_MIN_NUMEL
            with torch.no_grad():
                ds = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(width)]
                _fused_fn(torch.zeros(n), torch.zeros(n), torch.zeros(width + 2), *ds)
        except Exception as exc:  # no C++ compiler, unsupported platform, ...
            _fused_failed = f"fused outer-step kernel unavailable: {type(exc).__name__}: {exc}"
            raise RuntimeError(_fused_failed) from exc
        _fused_widths.add(width)
        return _fused_fn


def _pick_fused(kernel: Kernel, params: int, contributors: int) -> Callable[..., None] | None:
    """The compiled kernel when ``kernel`` asks for it (``auto``: large models only), or None."""
    if kernel not in ("auto", "eager", "fused"):
        raise ValueError(f"kernel must be 'auto', 'eager' or 'fused', not {kernel!r}")
    if kernel == "eager" or contributors > _FUSED_MAX_CONTRIBUTORS:
        return None
    if kernel == "fused":
        return _get_fused(_width(contributors))
    if params < _FUSED_MIN_PARAMS:
        return None
    try:
        return _get_fused(_width(contributors))
    except RuntimeError as exc:
        log.warning("%s; using the eager kernel", exc)
        return None


def _merge_fused(
    fn: Callable[..., None], w: Tensor, b: Tensor, ds: list[Tensor], coef: Tensor
) -> None:
    flat = [d.reshape(-1) for d in ds]
    # Pad to a multiple of the arity with zero-share views of Δ_0: 0 · Δ_0 adds exactly nothing.
    flat += [flat[0].view(-1) for _ in range(_width(len(flat)) - len(flat))]
    fn(w.view(-1), b.view(-1), coef, *flat)


def warm_up(params: int, kernel: Kernel = "auto") -> bool:
    """Compile now the kernel a merge of a ``params``-parameter model would compile on first
    use (up to ``_FUSED_ARITY`` contributors); True when a compiled kernel is ready.

    The coordinator calls this in the background when it loads a run, so the first round's
    merge does not pay the compile (seconds) while every site waits for the new model.
    """
    try:
        return _pick_fused(kernel, params, 1) is not None
    except RuntimeError:
        return False


def outer_step(
    master: MutableMapping[str, Tensor],
    momentum: MutableMapping[str, Tensor],
    deltas: Sequence[Mapping[str, Tensor]],
    tokens: Sequence[int],
    config: OuterConfig = OuterConfig(),
    *,
    kernel: Kernel = "auto",
    row_weights: Mapping[str, Tensor] | None = None,
) -> OuterStepReport:
    """Apply one elastic outer step to ``master`` and ``momentum`` in place.

    ``master`` holds contiguous fp32 tensors; ``momentum`` is empty before the first step
    (then filled with ``b = g``) or holds fp32 tensors of the same shapes. ``deltas`` are
    mappings of bf16 or fp32 tensors, possibly lazy (each tensor is read once);
    ``tokens[i]`` is the token count behind ``deltas[i]``.

    Contributors are the deltas with a positive token count; zero-token deltas are not read.
    With no contributor nothing is applied and the report says so. ``η`` and ``β`` come from
    ``config.step_for`` (the preset). With ``paper``, exactly one contributor and
    ``config.solo_full_step`` the step uses ``η = 1``: an outer rate below one
    exists to damp the disagreement between averaged sites, and a lone site has none, so a
    smaller step would only throw away ``1 − η`` of the work that site did. Momentum
    accumulates as in any other round.

    Key sets, dtypes and shapes are checked before anything is written where the mapping
    allows it (keys always; dtype and shape as each tensor is read). Finiteness is not
    re-checked here: run :func:`validate_delta` when a delta arrives. If a ``DeltaError``
    escapes mid-way, earlier tensors are already updated: restore from the last checkpoint.

    ``kernel``: ``"eager"`` (blocked torch ops), ``"fused"`` (compiled single pass; raises
    if it cannot be compiled) or ``"auto"`` (fused for models of 16M+ parameters when it
    compiles, else eager). Both agree with ``torch.optim.SGD`` to fp32 rounding.

    ``row_weights``: for a tensor named there, each live contributor's weight on each of
    its rows (``[contributors, rows]``, :func:`crossfed.rowcounts.row_weights`) replaces the
    token shares in its pseudo-gradient; the step applied to it is the same.
    """
    if len(deltas) != len(tokens):
        raise ValueError(f"{len(deltas)} deltas but {len(tokens)} token counts")
    counts = _token_counts(tokens)
    total = sum(counts)
    live = [i for i, n in enumerate(counts) if n > 0]
    if not live:
        return OuterStepReport(
            contributors=0, eta_used=0.0, tokens=0, shares=[0.0] * len(counts), applied=False
        )
    shares = token_shares(counts)
    eta, beta = config.step_for([shares[i] for i in live])
    _check_state(master, momentum)
    for i in live:
        _check_keys(master, deltas[i])

    fresh = not momentum
    plan = _plan([shares[i] for i in live], eta, beta, [w.numel() for w in master.values()], kernel)
    with torch.no_grad():
        for name, w in master.items():
            ds = [_check_meta(name, w, deltas[i][name]) for i in live]
            if fresh:  # zeros make β b + g == g exactly, so the fused kernel needs no variant
                momentum[name] = torch.empty_like(w) if plan.fused is None else torch.zeros_like(w)
            _apply(plan, w, momentum[name], ds, fresh, (row_weights or {}).get(name))
            del ds
    return OuterStepReport(
        contributors=len(live),
        eta_used=eta,
        beta_used=beta,
        tokens=total,
        shares=shares,
        applied=True,
    )


@dataclass
class _Plan:
    """What one outer step applies to every tensor, worked out once."""

    ps: list[float]
    beta: float
    eta: float
    fused: Callable[..., None] | None
    coef: Tensor
    scratch: tuple[Tensor, Tensor]


def _plan(ps: list[float], eta: float, beta: float, numels: list[int], kernel: Kernel) -> _Plan:
    """The kernel (by model size and contributors), its coefficients and eager scratch."""
    fused = _pick_fused(kernel, sum(numels), len(ps))
    padding = [0.0] * (_width(len(ps)) - len(ps))
    coef = torch.tensor([*ps, *padding, beta, eta], dtype=torch.float32)
    block = min(_EAGER_BLOCK, max(numels, default=0))
    return _Plan(ps, beta, eta, fused, coef, (torch.empty(block), torch.empty(block)))


def _apply(
    plan: _Plan, w: Tensor, b: Tensor, ds: list[Tensor], fresh: bool, rows: Tensor | None = None
) -> None:
    """Eq. 1 on one tensor, in place on ``w`` and ``b`` (fresh: ``b`` holds no momentum yet,
    and is zeros when the fused kernel is in use). ``rows``: per-row weights of the
    contributors (``[contributors, rows]``) in place of their token shares."""
    if rows is not None:
        g = _row_weighted(w, ds, rows)
        fresh_eager = fresh and plan.fused is None
        _merge_eager(w, b, [g], [1.0], plan.beta, plan.eta, fresh_eager, plan.scratch)
        return
    if (
        plan.fused is not None
        and w.numel() >= _FUSED_MIN_NUMEL
        and all(d.dtype == torch.bfloat16 for d in ds)
    ):
        _merge_fused(plan.fused, w, b, ds, plan.coef)
    else:
        _merge_eager(
            w, b, ds, plan.ps, plan.beta, plan.eta, fresh and plan.fused is None, plan.scratch
        )


def _row_weighted(w: Tensor, ds: list[Tensor], rows: Tensor) -> Tensor:
    """``Σ_i rows[i, r] Δ_i[r]`` row by row, in fp32, shaped like ``w`` (a matrix, or a
    tensor of higher order taken as rows by the rest). Each product is rounded to fp32
    before it is added (two kernels: ``addcmul_`` fuses them on CPUs with FMA), so a replay
    of the same formula in another library agrees to the bit."""
    if w.dim() < 1 or tuple(rows.shape) != (len(ds), w.shape[0]):
        raise DeltaError(
            f"row weights of shape {tuple(rows.shape)} do not fit {len(ds)} deltas of a "
            f"tensor of shape {tuple(w.shape)}"
        )
    out = torch.zeros(w.shape[0], w.numel() // w.shape[0])
    product = torch.empty_like(out)
    for d, r in zip(ds, rows, strict=True):
        out.add_(torch.mul(d.reshape(out.shape).float(), r[:, None], out=product))
    return out.reshape(w.shape)


def _state_tensor(source: Mapping[str, Tensor], name: str, ref: Tensor, role: str) -> Tensor:
    """``source[name]``, checked to be a contiguous fp32 tensor shaped like ``ref``."""
    value = source[name]
    if (
        not isinstance(value, Tensor)
        or value.dtype != torch.float32
        or not value.is_contiguous()
        or value.shape != ref.shape
    ):
        raise StateError(
            f"{role} tensor {name!r} must be a contiguous float32 tensor of shape "
            f"{tuple(ref.shape)}"
        )
    return value


def stream_outer_step(
    shapes: Mapping[str, Sequence[int]],
    master: Mapping[str, Tensor],
    momentum: Mapping[str, Tensor] | None,
    deltas: Sequence[Mapping[str, Tensor]],
    tokens: Sequence[int],
    emit: Callable[[str, Tensor, Tensor | None], None],
    config: OuterConfig = OuterConfig(),
    *,
    kernel: Kernel = "auto",
    row_weights: Mapping[str, Tensor] | None = None,
) -> OuterStepReport:
    """:func:`outer_step` for state that lives in files, one tensor at a time.

    For each name of ``shapes``, in order: ``master[name]`` and ``momentum[name]`` are read
    once (fp32 tensors this function overwrites: fresh ones, or views of buffers the caller
    reuses), each contributor's delta tensor is read once, the same arithmetic as
    :func:`outer_step` runs on them (so the results are equal bit for bit), and
    ``emit(name, w, b)`` receives the new master and momentum tensors, valid during that call
    only. So the step holds one tensor of each role at a time, whatever the model's size.

    ``momentum`` is None or empty before the first step. With no contributor nothing is
    applied: ``emit`` gets the tensors as read (``b`` None when there is no momentum). Key
    sets are checked before the first tensor is read; dtypes and shapes as each is read.
    ``row_weights``: as :func:`outer_step`'s, by the names of ``shapes``.
    """
    if len(deltas) != len(tokens):
        raise ValueError(f"{len(deltas)} deltas but {len(tokens)} token counts")
    counts = _token_counts(tokens)
    live = [i for i, n in enumerate(counts) if n > 0]
    refs = {name: torch.empty(tuple(shape), device="meta") for name, shape in shapes.items()}
    fresh = not momentum
    if momentum and set(momentum.keys()) != set(refs):
        missing = sorted(set(refs).difference(momentum.keys()))
        extra = sorted(set(momentum.keys()).difference(refs))
        raise StateError(
            "momentum must be empty or hold exactly the master's tensors; "
            f"missing {_names(missing) or 'none'}, unexpected {_names(extra) or 'none'}"
        )
    if not live:
        for name, ref in refs.items():
            w = _state_tensor(master, name, ref, "master")
            emit(name, w, None if fresh else _state_tensor(momentum or {}, name, ref, "momentum"))
        return OuterStepReport(
            contributors=0, eta_used=0.0, tokens=0, shares=[0.0] * len(counts), applied=False
        )
    shares = token_shares(counts)
    eta, beta = config.step_for([shares[i] for i in live])
    for i in live:
        _check_keys(refs, deltas[i])
    plan = _plan([shares[i] for i in live], eta, beta, [r.numel() for r in refs.values()], kernel)
    with torch.no_grad():
        for name, ref in refs.items():
            w = _state_tensor(master, name, ref, "master")
            if fresh:
                b = torch.empty_like(w) if plan.fused is None else torch.zeros_like(w)
            else:
                b = _state_tensor(momentum or {}, name, ref, "momentum")
            ds = [_check_meta(name, ref, deltas[i][name]) for i in live]
            _apply(plan, w, b, ds, fresh, (row_weights or {}).get(name))
            del ds
            emit(name, w, b)
            del w, b
    return OuterStepReport(
        contributors=len(live),
        eta_used=eta,
        beta_used=beta,
        tokens=sum(counts),
        shares=shares,
        applied=True,
    )
