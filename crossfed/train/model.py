"""torchtitan's Qwen3 for crossfed: flavours by name, CPU/GPU attention, flat parameter maps.

Named flavours come from torchtitan's own registry (``0.6B``, ``1.7B``, ...) plus crossfed's
small CPU flavours built from the same torchtitan config classes. The tokenizer's vocabulary
sets the embedding size. FlexAttention has no backward on CPU, so CPU models use torchtitan's
``ScaledDotProductAttention`` (causal); GPU models keep flex.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import (
    _EMBEDDING_SKIP_INIT,
    _LINEAR_INIT,
    Qwen3Model,
    _build_qwen3_layers,
    _qwen3_norm,
    qwen3_configs,
)

from crossfed.moments import is_side_key


class ModelConfigError(ValueError):
    """An unknown flavour or an impossible model setting."""


def _small(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int
) -> Callable[[str], Qwen3Model.Config]:
    """A dense Qwen3 flavour of the given size, built with torchtitan's config builders."""

    def build(attn_backend: str) -> Qwen3Model.Config:
        head_dim = dim // n_heads
        vocab = 4096
        return Qwen3Model.Config(
            vocab_size=vocab,
            dim=dim,
            norm=_qwen3_norm(dim),
            enable_weight_tying=True,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT
            ),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
            layers=_build_qwen3_layers(
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                hidden_dim=hidden_dim,
                attn_backend=attn_backend,
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1_000_000.0),
            ),
        )

    return build


#: crossfed's own CPU-sized flavours; every torchtitan Qwen3 flavour is available too.
LOCAL_FLAVOURS: dict[str, Callable[[str], Qwen3Model.Config]] = {
    "tiny": _small(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384),
    "small": _small(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, hidden_dim=768),
}


def _is_moe(flavour: str, config: Qwen3Model.Config) -> bool:
    return "moe" in flavour.lower() or any(layer.moe is not None for layer in config.layers)


def flavour_names() -> list[str]:
    """Every flavour name ``build_model`` accepts: crossfed's, then torchtitan's dense Qwen3."""
    dense = [name for name, build in qwen3_configs.items() if not _is_moe(name, build("flex"))]
    return sorted(LOCAL_FLAVOURS) + sorted(dense)


def model_config(flavour: str, *, vocab_size: int, device: str = "cpu") -> Qwen3Model.Config:
    """torchtitan config of ``flavour`` with the tokenizer's vocabulary and device's attention."""
    factory = LOCAL_FLAVOURS.get(flavour) or qwen3_configs.get(flavour)
    if factory is None:
        raise ModelConfigError(
            f"unknown model flavour {flavour!r}; choose one of {', '.join(flavour_names())}"
        )
    if vocab_size < 2:
        raise ModelConfigError(f"vocab_size must be >= 2, got {vocab_size}")
    config = factory("flex")
    if _is_moe(flavour, config):
        raise ModelConfigError(
            f"flavour {flavour!r} is a mixture-of-experts model; crossfed trains dense Qwen3"
        )
    config.vocab_size = vocab_size
    config.tok_embeddings.num_embeddings = vocab_size
    config.lm_head.out_features = vocab_size
    if not device.startswith("cuda"):
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build_model(
    flavour: str, *, vocab_size: int, seed: int = 0, device: str = "cpu"
) -> torch.nn.Module:
    """A freshly initialised Qwen3 model; the same (flavour, vocab, seed) gives the same weights."""
    config = model_config(flavour, vocab_size=vocab_size, device=device)
    with torch.device(device):
        model = config.build()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    torch.random.set_rng_state(generator_state)
    return model


def _meta_model(flavour: str, vocab_size: int) -> torch.nn.Module:
    """The model's structure without storage (tied weights tied, as ``init_states`` ties them)."""
    config = model_config(flavour, vocab_size=vocab_size, device="cpu")
    with torch.device("meta"):
        model = config.build()
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight
    return model


def parameter_shapes(flavour: str, *, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in :func:`parameters_of` order, with no tensor allocated."""
    return {n: tuple(p.shape) for n, p in parameters_of(_meta_model(flavour, vocab_size)).items()}


def _init_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``init_states`` initialises, in its order: each top-level child, with the
    layers one by one (each unit's init is self-contained; together they draw the random
    numbers in the order a whole-model init does)."""
    units: list[tuple[str, torch.nn.Module]] = []
    for name, child in model.named_children():
        if name == "layers":
            units += [(f"layers.{key}", layer) for key, layer in child.named_children()]
        else:
            units.append((name, child))
    return units


def _initialised(
    units: list[tuple[str, torch.nn.Module]], seed: int
) -> Iterator[tuple[int, torch.nn.Module]]:
    """Each unit in turn, materialised on the CPU and initialised from the seeded stream;
    it goes back to the meta device (its storage freed) when the caller moves on. The
    stream's generator state is swapped in only while a unit draws, so whatever the caller
    does between units neither disturbs it nor sees it."""
    callers = torch.random.get_rng_state()
    torch.manual_seed(seed)
    stream = torch.random.get_rng_state()
    torch.random.set_rng_state(callers)
    for index, (_, unit) in enumerate(units):
        callers = torch.random.get_rng_state()
        torch.random.set_rng_state(stream)
        try:
            unit.to_empty(device="cpu")
            with torch.no_grad():
                unit.init_states(buffer_device=torch.device("cpu"))
            stream = torch.random.get_rng_state()
        finally:
            torch.random.set_rng_state(callers)
        yield index, unit
        unit.to("meta")


def initial_parameters(
    flavour: str, *, vocab_size: int, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`build_model`'s parameters, bit for bit and in :func:`parameters_of` order, with
    one layer (or the embedding) in memory at a time, so creating a run of any size needs
    no more memory than its largest unit. A tied weight is named first but drawn last (by
    the output layer): it is drawn in a first pass over the units and held until its turn."""
    model = _meta_model(flavour, vocab_size)
    canonical = {id(p): name for name, p in model.named_parameters()}
    units = _init_units(model)
    owner: dict[str, tuple[int, str]] = {}  # the unit whose init sets it (the last to hold it)
    for index, (_, unit) in enumerate(units):
        for local, p in unit.named_parameters():
            owner[canonical[id(p)]] = (index, local)
    early = {name for name, (i, _) in owner.items() if not name.startswith(units[i][0] + ".")}
    held: dict[str, torch.Tensor] = {}
    if early:
        wanted = {owner[name]: name for name in early}
        for index, unit in _initialised(units, seed):
            params = dict(unit.named_parameters())
            for (i, local), name in wanted.items():
                if i == index:
                    held[name] = params[local].detach().clone()
    order = list(canonical.values())
    for index, unit in _initialised(units, seed):
        prefix = units[index][0] + "."
        params = dict(unit.named_parameters())
        for name in order:
            if name.startswith(prefix):
                yield name, held.pop(name) if name in held else params[name[len(prefix) :]].detach()


def attention_masks(model: torch.nn.Module, batch: int, seq_len: int, device: Any) -> Any:
    """What a masked attention backend (flex on GPU) needs for ``batch`` windows of
    ``seq_len`` tokens, each window one causal document; None for SDPA (causal built in).
    Built once per shape and kept on the model."""
    config = getattr(model, "config", None)
    inner = getattr(getattr(config, "first_attention", None), "inner_attention", None)
    if inner is None or isinstance(inner, ScaledDotProductAttention.Config):
        return None
    cache = model.__dict__.setdefault("_crossfed_attention_masks", {})
    key = (batch, seq_len, str(device))
    if key not in cache:
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        cache[key] = model.get_attention_masks(positions)
    return cache[key]


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, tied weights once (the wire and checkpoint layout)."""
    return {name: p for name, p in model.named_parameters()}


def matching_parameters(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's parameters, after checking ``tensors`` has exactly their names and shapes
    (a global model's second-moment factors, :mod:`crossfed.moments`, are not parameters)."""
    params = parameters_of(model)
    names = {name for name in tensors if not is_side_key(name)}
    missing = sorted(set(params) - names)
    extra = sorted(names - set(params))
    if missing or extra:
        raise ModelConfigError(
            f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, param in params.items():
        shape = tuple(tensors[name].shape)
        if shape != tuple(param.shape):
            raise ModelConfigError(f"parameter {name}: shape {shape} != model {tuple(param.shape)}")
    return params


@torch.no_grad()
def load_parameters(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the model's parameters; every name must match in name and shape."""
    for name, param in matching_parameters(model, tensors).items():
        param.copy_(tensors[name])


def count_parameters(model: torch.nn.Module) -> int:
    """Number of unique trainable parameters."""
    return sum(p.numel() for p in parameters_of(model).values())


def flops_per_token(model: torch.nn.Module, flavour: str, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), torchtitan's estimate for dense Qwen3."""
    config = model_config(flavour, vocab_size=vocab_size)
    with _torchtitan_info_at_debug():
        _, flops = config.get_nparams_and_flops(model, seq_len)
    return float(flops)


class _DebugOnly(logging.Filter):
    """Lets a root-logger INFO record through only when debug logging is on (``-v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or logging.getLogger().isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def _torchtitan_info_at_debug() -> Iterator[None]:
    """torchtitan logs on the root logger; its INFO lines (the "Total parameter count" of
    every model) show only with ``-v`` while the block runs."""
    root, quiet = logging.getLogger(), _DebugOnly()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)
