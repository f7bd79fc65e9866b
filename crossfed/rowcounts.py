"""How often each token was an input in a site's phase, and the row-weighted merge it feeds.

An embedding row moves only where its token occurs. A site that never saw a token sends
(nearly) nothing for its row, so the token-weighted mean of three sites' deltas gives a
row that one site learned a third of that site's step: rare tokens learn at a fraction of
the pace centralised training gives them. Each site sends, beside its delta, the number of
times each token was an input of the windows it trained (``rows::<parameter>``, one fp32
number per row); with ``outer.embedding_rows: counts`` the coordinator averages each row of
that parameter over the sites in proportion to those counts, a row no site saw this round
by the token shares. The pseudo-gradient of every other tensor, and the outer step applied
to it, are unchanged.

A phase of an overlapped round counts only the windows it trained after its fold-in
(``PhaseState.counted_from``): the steps before it ran on the site's own weights, and their
row updates, measured against rows the merge has since moved, do not claim those rows.

Measured in ``bench/quality.py`` (docs/quality.md, "Embedding rows weighted by their
tokens"): at H=25 it takes three sites from 1.35 to 1.18 of centralised training's
held-out perplexity in plain rounds, and from 1.44 to 1.36 in overlapped ones (the
workflow's default): ``counts`` is the default of a new run. numpy and torch are imported
where the arithmetic needs them: the run spec reads the modes when the workflow is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

#: the key prefix of row counts inside a delta file
PREFIX = "rows::"
#: ``outer.embedding_rows``: rows weighted by their token counts, or by token shares
COUNTS, SHARES = "counts", "shares"
MODES = (COUNTS, SHARES)
#: the mode of a new run whose config leaves ``outer.embedding_rows`` unset: ``counts``
#: gains in plain and overlapped rounds alike (docs/quality.md)
DEFAULT_MODE = COUNTS
#: the mode of a run stored before the setting existed (what those runs did)
LEGACY_MODE = SHARES
#: torchtitan's token embedding (tied to the output head in Qwen3's small flavours)
EMBEDDING = "tok_embeddings.weight"


def is_count_key(name: str) -> bool:
    """Whether a tensor name in a delta file is an embedding's row counts."""
    return name.startswith(PREFIX)


def count_key(param: str) -> str:
    return f"{PREFIX}{param}"


def token_counts(windows: np.ndarray, vocab_size: int) -> Tensor:
    """How often each token id is an input (a window's every position but its last) in
    ``windows`` (rows of ``seq_len + 1`` token ids), as fp32 of length ``vocab_size``."""
    import numpy as np
    import torch

    inputs = np.asarray(windows)[..., :-1].reshape(-1).astype(np.int64, copy=False)
    if inputs.size and (inputs.min() < 0 or inputs.max() >= vocab_size):
        raise ValueError(f"a token id lies outside the vocabulary of {vocab_size}")
    return torch.from_numpy(np.bincount(inputs, minlength=vocab_size).astype(np.float32))


def problem(counts: Mapping[str, Tensor], shapes: Mapping[str, Sequence[int]]) -> str | None:
    """What is wrong with a delta's row counts against the model's shapes (None: nothing)."""
    import torch

    for key, value in counts.items():
        param = key.removeprefix(PREFIX)
        if param not in shapes:
            return f"{key!r} counts rows of no tensor of the model"
        rows = tuple(shapes[param])[0] if tuple(shapes[param]) else 1
        if value.dim() != 1 or value.shape[0] != rows:
            return f"{key!r} has shape {tuple(value.shape)}; {param!r} has {rows} rows"
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            return f"{key!r} holds a negative or non-finite count"
    return None


def row_weights(counts: Sequence[Tensor | None], shares: Sequence[float]) -> Tensor | None:
    """Each contributor's weight on each row, ``[contributors, rows]`` fp32: its count over
    the row's total where any contributor saw the row, its token share where none did.
    ``counts`` and ``shares`` are the live contributors', in order; None when one of them
    sent no counts (the tensor is then merged with the token shares)."""
    import torch

    if not counts or any(c is None for c in counts):
        return None
    n = torch.stack([c.to(torch.float64) for c in counts if c is not None])
    total = n.sum(0)
    seen = total > 0
    fallback = torch.tensor(list(shares), dtype=torch.float64)[:, None].expand_as(n)
    weights = torch.where(seen, n / torch.where(seen, total, 1.0), fallback)
    return weights.to(torch.float32)
