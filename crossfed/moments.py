"""The sites' AdamW second moment, shared at a merge as row and column factors.

Each site keeps its own AdamW state across rounds (DiLoCo). Left alone, a site's second
moment knows only the data it trained: the embedding rows of tokens that its windows rarely
hold have a small second moment, so once the merged model has moved those rows (other sites
saw the tokens), the site's next steps on them are far too large. Averaging the sites'
second moments at every merge closes much of the gap to centralised training
(docs/quality.md), but would send a second model-sized tensor each way every round.

What travels instead are Adafactor's factors (Shazeer & Stern 2018, arXiv 1804.04235) of each
site's second moment ``v``: per matrix its row means, column means and overall mean (a vector
or scalar parameter travels whole), about ``rows + columns`` numbers per matrix instead of
``rows * columns``. The coordinator averages them with the deltas' token shares; a site that
adopts the merged model rescales its own ``v`` so that its factors become the merged ones:
``v <- v * A(merged) / A(own)`` with ``A(r, c, m) = r c^T / m`` the factored approximation.
A row whose scale differs between sites (a token one site rarely sees) takes the sites'
mean scale, and the site keeps the structure within it.

Pure tensor functions, plus the two that read and write an optimiser's state (sharded
parameters included: those are collectives that every rank calls). torch is imported where
the arithmetic needs it: the run spec reads this module's modes when the workflow is read
(``crossfed.resume``), and that stays free of torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from crossfed import rowcounts

if TYPE_CHECKING:
    import torch
    from torch import Tensor

#: the key prefix of second-moment factors inside a delta file and a global model file
PREFIX = "moments::"
#: ``inner.second_moment``: each site keeps its own, or the factors are shared at merges
OWN, SHARED = "own", "shared"
MODES = (OWN, SHARED)
#: the mode of a new run whose config leaves ``inner.second_moment`` unset
DEFAULT_MODE = SHARED
#: the mode of a run stored before the setting existed (what those runs did)
LEGACY_MODE = OWN
ROW, COL, MEAN, FULL = "row", "col", "mean", "full"
_TINY = 1e-30


def is_moment_key(name: str) -> bool:
    """Whether a tensor name in a delta or global model file is a second-moment factor."""
    return name.startswith(PREFIX)


def is_side_key(name: str) -> bool:
    """Whether a tensor name in a delta or model file is one that travels beside the model's:
    a second-moment factor, or an embedding's row counts (:mod:`crossfed.rowcounts`)."""
    return name.startswith((PREFIX, rowcounts.PREFIX))


def without_moments(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The model's tensors of a file that may also hold second-moment factors."""
    return {k: v for k, v in tensors.items() if not is_moment_key(k)}


def only_moments(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The second-moment factors a file holds (empty: none)."""
    return {k: v for k, v in tensors.items() if is_moment_key(k)}


def factor_key(param: str, part: str) -> str:
    return f"{PREFIX}{param}::{part}"


def factors(v: Tensor) -> dict[str, Tensor]:
    """A second moment's factors, in fp32: a matrix (or higher: as rows by the rest) gives
    its row means, column means and mean; a vector or scalar gives itself."""
    v = v.detach().float()
    if v.dim() < 2:
        return {FULL: v.clone()}
    rows = v.reshape(v.shape[0], -1)
    return {ROW: rows.mean(1), COL: rows.mean(0), MEAN: rows.mean()}


def approximation(parts: Mapping[str, Tensor], shape: torch.Size | Sequence[int]) -> Tensor:
    """What the factors say the whole second moment is: ``row col^T / mean``."""
    import torch

    if FULL in parts:
        return parts[FULL].reshape(shape)
    outer = torch.outer(parts[ROW], parts[COL]) / parts[MEAN].clamp_min(_TINY)
    return outer.reshape(shape)


def rescaled(v: Tensor, merged: Mapping[str, Tensor]) -> Tensor:
    """``v`` with its factors replaced by ``merged``'s (fp32); where ``v``'s own approximation
    is zero (a parameter it never stepped), the merged approximation itself."""
    import torch

    v = v.detach().float()
    target = approximation(merged, v.shape).to(v.device)
    own = approximation(factors(v), v.shape).to(v.device)
    ratio = target / own.clamp_min(_TINY)
    return torch.where(own > _TINY, v * ratio, target)


def expected_shapes(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """The key and shape of every factor of a model whose parameters have ``shapes``."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if len(shape) < 2:
            out[factor_key(name, FULL)] = tuple(shape)
        else:
            out[factor_key(name, ROW)] = (shape[0],)
            out[factor_key(name, COL)] = (math.prod(shape[1:]),)
            out[factor_key(name, MEAN)] = ()
    return out


def problem(sent: Mapping[str, Tensor], shapes: Mapping[str, Sequence[int]]) -> str | None:
    """What is wrong with a site's factors for a model of ``shapes`` (None: nothing): a key
    the model has no factor for, a shape that is not the factor's, a value that is not
    finite or is negative (a second moment is neither)."""
    import torch

    want = expected_shapes(shapes)
    for key, value in sent.items():
        if key not in want:
            return f"{key!r} is no factor of this model's parameters"
        if tuple(value.shape) != want[key]:
            return f"{key!r} has shape {tuple(value.shape)}; expected {want[key]}"
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            return f"{key!r} holds a negative or non-finite value"
    return None


def merge(
    contributions: Sequence[Mapping[str, Tensor]], tokens: Sequence[int]
) -> dict[str, Tensor]:
    """The token-weighted mean of the sites' factors, key by key, over the contributions
    that hold the key and a positive token count (a site that sent none is left out)."""
    merged: dict[str, Tensor] = {}
    keys = sorted({k for c in contributions for k in c})
    weighted = list(zip(contributions, tokens, strict=True))
    for key in keys:
        pairs = [(c[key].float(), n) for c, n in weighted if key in c and n > 0]
        if not pairs:
            continue
        total = float(sum(n for _, n in pairs))
        merged[key] = sum(t * (n / total) for t, n in pairs)  # type: ignore[assignment]
    return merged


def _full(value: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def bias_correction(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> float:
    """AdamW's ``1 - beta2^step`` for ``param``: its raw ``exp_avg_sq`` over this is the
    second moment the steps use. Sites that took different numbers of steps (a probe
    round, paced leases) hold raw moments biased by different factors, so what they share
    is the corrected one."""
    state = optimizer.state[param]
    beta2 = next(
        g["betas"][1] for g in optimizer.param_groups if any(p is param for p in g["params"])
    )
    step = float(state["step"])
    return 1.0 - beta2**step


def state_factors(
    params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> dict[str, Tensor]:
    """The factors of every parameter's bias-corrected AdamW second moment (``exp_avg_sq``
    over :func:`bias_correction`), keyed for a file (on CPU). A collective when parameters
    are sharded: every rank calls it, in the same order."""
    out: dict[str, Tensor] = {}
    for name, param in params.items():
        state = optimizer.state.get(param, {})
        if "exp_avg_sq" not in state:
            continue
        corrected = _full(state["exp_avg_sq"]).float() / bias_correction(optimizer, param)
        for part, value in factors(corrected).items():
            out[factor_key(name, part)] = value.cpu()
    return out


def adopt(
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    merged: Mapping[str, Tensor],
) -> int:
    """Rescale every parameter's bias-corrected ``exp_avg_sq`` to the merged factors (and
    bias it again by its own step count); returns how many parameters changed. Parameters
    without state or without merged factors keep theirs. A collective when parameters are
    sharded: every rank calls it with the same ``merged``."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        changed = 0
        for name, param in params.items():
            state = optimizer.state.get(param, {})
            if "exp_avg_sq" not in state:
                continue
            parts = _parts_of(merged, name)
            if parts is None:
                continue
            v = state["exp_avg_sq"]
            correction = bias_correction(optimizer, param)
            new = rescaled(_full(v).float() / correction, parts) * correction
            if isinstance(v, DTensor):
                local = distribute_tensor(new.to(v.device), v.device_mesh, v.placements)
                v.to_local().copy_(local.to_local())
            else:
                v.copy_(new)
            changed += 1
        return changed


def _parts_of(merged: Mapping[str, Tensor], name: str) -> dict[str, Tensor] | None:
    full = merged.get(factor_key(name, FULL))
    if full is not None:
        return {FULL: full}
    parts = {p: merged.get(factor_key(name, p)) for p in (ROW, COL, MEAN)}
    if any(t is None for t in parts.values()):
        return None
    return parts  # type: ignore[return-value]
