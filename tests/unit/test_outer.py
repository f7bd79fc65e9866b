"""The elastic token-weighted Nesterov outer step (paper Eq. 1), pinned against torch.optim.SGD."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from crossfed import outer
from crossfed.outer import (
    DeltaError,
    StateError,
    outer_step,
    stream_outer_step,
    token_shares,
    validate_delta,
)
from crossfed.outer_presets import (
    AVERAGE_STEP,
    DEFAULT_PRESET,
    PRESETS,
    TUNED_BETA,
    TUNED_SOLO_ETA,
    OuterConfig,
)

SHAPES = {
    "embed.weight": (97, 24),
    "layers.0.attn.wq": (24, 48),
    "layers.0.attn.q_norm": (8,),
    "layers.0.mlp.w1": (3, 5, 70),
    "layers.0.scale": (1,),
    "layers.1.mlp.w2": (5000,),  # spans several eager blocks (see small_blocks)
    "norm.weight": (24,),
}
KERNELS = ["eager", pytest.param("fused", marks=pytest.mark.slow)]
PIN = 2e-6


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the eager block and the fused size floor so small tensors exercise both paths."""
    monkeypatch.setattr(outer, "_EAGER_BLOCK", 1000)
    monkeypatch.setattr(outer, "_FUSED_MIN_NUMEL", 64)


def make_master(gen: torch.Generator, scale: float = 0.5) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, generator=gen) * scale for k, s in SHAPES.items()}


def make_delta(
    gen: torch.Generator, dtype: torch.dtype = torch.bfloat16, scale: float = 0.01
) -> dict[str, torch.Tensor]:
    return {k: (torch.randn(s, generator=gen) * scale).to(dtype) for k, s in SHAPES.items()}


def clone(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def max_abs(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a)


class CountingDelta(Mapping[str, torch.Tensor]):
    """A lazily read delta that records how often each tensor is fetched."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.reads: dict[str, int] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class SafetensorsDelta(Mapping[str, torch.Tensor]):
    """The coordinator's shape of delta: tensors fetched one at a time from an open file."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.handle.keys())

    def __len__(self) -> int:
        return len(list(self.handle.keys()))


@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_torch_sgd_nesterov_over_elastic_rounds(kernel: str, small_blocks: None) -> None:
    gen = torch.Generator().manual_seed(1234)
    master = make_master(gen)
    start = clone(master)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in master.items()}
    cfg = OuterConfig()
    opt = torch.optim.SGD(params.values(), lr=cfg.eta, momentum=cfg.beta, nesterov=True)
    momentum: dict[str, torch.Tensor] = {}
    seen_k: set[int] = set()
    worst = 0.0
    for rnd in range(60):
        solo = rnd in (0, 1) or rnd % 7 == 0
        k = 1 if solo else int(torch.randint(1, 5, (1,), generator=gen))
        seen_k.add(k)
        dtypes = [torch.float32 if (rnd + i) % 9 == 0 else torch.bfloat16 for i in range(k)]
        deltas = [make_delta(gen, dt) for dt in dtypes]
        tokens = [int(n) for n in torch.randint(1, 10**6, (k,), generator=gen)]

        report = outer_step(master, momentum, deltas, tokens, cfg, kernel=kernel)

        shares = [n / sum(tokens) for n in tokens]
        for name, p in params.items():
            acc = deltas[0][name].float() * shares[0]
            for d, share in zip(deltas[1:], shares[1:], strict=True):
                acc = acc + d[name].float() * share
            p.grad = -acc
        opt.param_groups[0]["lr"] = 1.0 if k == 1 else cfg.eta
        opt.step()

        assert report.applied and report.contributors == k
        assert report.eta_used == (1.0 if k == 1 else cfg.eta)
        assert report.tokens == sum(tokens)
        buffers = {name: opt.state[p]["momentum_buffer"] for name, p in params.items()}
        worst = max(worst, max_abs(master, params), max_abs(momentum, buffers))
    assert seen_k == {1, 2, 3, 4}
    print(f"max |outer_step - torch SGD| = {worst:.3g}")
    assert worst <= PIN, f"max |outer_step - torch SGD| = {worst:.3g}"
    assert max_abs(master, start) > 0.1  # the pin compares models that really moved


def _pin_without_momentum(
    cfg: OuterConfig, seed: int, eta_of, kernel: str, each_round=None
) -> None:
    """40 elastic rounds of ``cfg`` against torch's SGD without momentum at ``eta_of(shares)``
    on the token-weighted pseudo-gradient; ``each_round(before, deltas, shares)`` checks more."""
    gen = torch.Generator().manual_seed(seed)
    master = make_master(gen)
    start = clone(master)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in master.items()}
    opt = torch.optim.SGD(params.values(), lr=1.0)
    momentum: dict[str, torch.Tensor] = {}
    seen_k: set[int] = set()
    worst = 0.0
    for rnd in range(40):
        k = 1 if rnd % 5 == 0 else int(torch.randint(1, 5, (1,), generator=gen))
        seen_k.add(k)
        before = clone(master)
        deltas = [make_delta(gen) for _ in range(k)]
        tokens = [int(n) for n in torch.randint(1, 10**6, (k,), generator=gen)]

        report = outer_step(master, momentum, deltas, tokens, cfg, kernel=kernel)

        shares = [n / sum(tokens) for n in tokens]
        want_eta = eta_of(shares)
        for name, p in params.items():
            p.grad = -sum(d[name].float() * share for d, share in zip(deltas, shares, strict=True))
        opt.param_groups[0]["lr"] = want_eta
        opt.step()
        assert report.eta_used == pytest.approx(want_eta, rel=1e-12)
        assert report.beta_used == 0.0
        worst = max(worst, max_abs(master, params))
        if each_round is not None:
            each_round(before, deltas, shares, master)
    assert seen_k == {1, 2, 3, 4}
    assert worst <= PIN, f"max |outer_step - torch SGD| = {worst:.3g}"
    assert max_abs(master, start) > 0.1


@pytest.mark.parametrize("kernel", KERNELS)
def test_tuned_preset_matches_torch_sgd_over_elastic_rounds(
    kernel: str, small_blocks: None
) -> None:
    """The tuned preset is torch's SGD with lr = TUNED_SOLO_ETA * sqrt(sum p_i^2) per round."""
    assert TUNED_BETA == 0.0  # so torch's SGD without momentum is the reference
    cfg = OuterConfig(preset="tuned", eta=0.7, beta=0.9)  # eta and beta are not used
    _pin_without_momentum(
        cfg, 4321, lambda shares: TUNED_SOLO_ETA * sum(p * p for p in shares) ** 0.5, kernel
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_average_preset_matches_torch_sgd_over_elastic_rounds(
    kernel: str, small_blocks: None
) -> None:
    """The average preset (the default) is torch's SGD with lr=1 and no momentum on the
    token-weighted pseudo-gradient: the master becomes the token-weighted mean of the site
    models, for one contributor or many."""
    cfg = OuterConfig(preset="average", eta=0.7, beta=0.9)  # eta and beta are not used
    assert (cfg.eta, cfg.beta) != AVERAGE_STEP == (1.0, 0.0)

    def is_the_mean(before, deltas, shares, master) -> None:
        for name, w in before.items():  # the mean of the site models w + delta_i
            mean = sum((w + d[name].float()) * p for d, p in zip(deltas, shares, strict=True))
            torch.testing.assert_close(master[name], mean, rtol=0, atol=PIN)

    _pin_without_momentum(cfg, 2468, lambda shares: 1.0, kernel, is_the_mean)


def test_the_default_preset_of_a_new_run_is_average() -> None:
    assert DEFAULT_PRESET == "average"
    assert PRESETS["average"].step_for([1.0]) == PRESETS["average"].step_for([0.2, 0.3, 0.5])
    assert PRESETS["average"].step_for([0.5, 0.5]) == AVERAGE_STEP


def test_tuned_preset_streams_the_same_step_and_refuses_an_unresolved_one() -> None:
    gen = torch.Generator().manual_seed(12)
    w0, deltas = make_master(gen), [make_delta(gen) for _ in range(3)]
    tokens = [100, 250, 650]
    in_memory = clone(w0)
    report = outer_step(in_memory, {}, deltas, tokens, PRESETS["tuned"])
    streamed: dict[str, torch.Tensor] = {}
    streamed_report = stream_outer_step(
        SHAPES, clone(w0), None, deltas, tokens,
        lambda name, w, b: streamed.__setitem__(name, w.clone()), PRESETS["tuned"],
    )  # fmt: skip
    assert all(torch.equal(streamed[k], in_memory[k]) for k in w0)
    assert streamed_report.eta_used == report.eta_used < TUNED_SOLO_ETA  # 3 sites step less
    with pytest.raises(ValueError, match="not resolved"):
        outer_step(clone(w0), {}, deltas, tokens, OuterConfig(preset=None))
    with pytest.raises(ValueError, match="preset must be one of 'average', 'paper', 'tuned'"):
        OuterConfig(preset="fast")  # type: ignore[arg-type]


def test_paper_preset_is_todays_outer_step() -> None:
    assert PRESETS["paper"] == OuterConfig()
    assert (OuterConfig().eta, OuterConfig().beta, OuterConfig().preset) == (0.7, 0.9, "paper")


@pytest.mark.parametrize("kernel", KERNELS)
def test_beta0_eta1_is_exact_fedavg(kernel: str, small_blocks: None) -> None:
    gen = torch.Generator().manual_seed(7)
    master = make_master(gen)
    momentum = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}  # ignored at β=0
    deltas = [make_delta(gen) for _ in range(3)]
    tokens = [1200, 300, 4500]
    sites = [{k: master[k] + d[k].float() for k in master} for d in deltas]
    shares = token_shares(tokens)
    fedavg = {k: sum(p * s[k].double() for p, s in zip(shares, sites, strict=True)) for k in master}

    outer_step(master, momentum, deltas, tokens, OuterConfig(eta=1.0, beta=0.0), kernel=kernel)

    eps = torch.finfo(torch.float32).eps
    for k, want in fedavg.items():
        err = (master[k].double() - want).abs()
        # within the fp32 rounding of the site models themselves (about one ulp)
        assert bool((err <= 2 * eps * want.abs() + 1e-9).all()), k


@pytest.mark.parametrize("kernel", KERNELS)
def test_solo_round_takes_the_full_step_and_accumulates_momentum(
    kernel: str, small_blocks: None
) -> None:
    gen = torch.Generator().manual_seed(3)
    w0 = make_master(gen)
    master, momentum = clone(w0), {}
    d1, d2 = make_delta(gen), make_delta(gen)
    idle = CountingDelta(make_delta(gen))  # zero tokens: not a contributor, never read
    beta = 0.9

    report = outer_step(master, momentum, [d1, idle], [500, 0], OuterConfig(), kernel=kernel)

    assert (report.contributors, report.eta_used, report.shares) == (1, 1.0, [1.0, 0.0])
    assert idle.reads == {}
    for k in w0:
        delta = d1[k].float()
        torch.testing.assert_close(momentum[k], -delta, rtol=0, atol=0)  # first step: b = g
        torch.testing.assert_close(master[k], w0[k] + (1 + beta) * delta, rtol=0, atol=PIN)

    w1, b1 = clone(master), clone(momentum)
    outer_step(master, momentum, [d2], [10], OuterConfig(), kernel=kernel)
    for k in w0:
        b2 = beta * b1[k] - d2[k].float()  # momentum keeps accumulating in solo rounds
        torch.testing.assert_close(momentum[k], b2, rtol=0, atol=PIN)
        torch.testing.assert_close(
            master[k], w1[k] - (-d2[k].float() + beta * b2), atol=PIN, rtol=0
        )


def test_solo_full_step_can_be_switched_off() -> None:
    gen = torch.Generator().manual_seed(4)
    w0 = make_master(gen)
    master, delta = clone(w0), make_delta(gen)
    report = outer_step(master, {}, [delta], [9], OuterConfig(solo_full_step=False))
    assert report.eta_used == 0.7
    for k in w0:
        want = w0[k] + 0.7 * 1.9 * delta[k].float()
        torch.testing.assert_close(master[k], want, rtol=0, atol=PIN)


def test_solo_round_without_momentum_adopts_the_site_model() -> None:
    gen = torch.Generator().manual_seed(5)
    w0 = make_master(gen)
    master, delta = clone(w0), make_delta(gen)
    outer_step(master, {}, [delta], [123], OuterConfig(beta=0.0))
    for k in w0:  # nothing of the lone site's update is discarded
        assert torch.equal(master[k], w0[k] + delta[k].float())


@pytest.mark.parametrize("tokens", [[], [0], [0, 0]])
def test_zero_contributors_change_nothing(tokens: list[int]) -> None:
    gen = torch.Generator().manual_seed(6)
    master = make_master(gen)
    w0 = clone(master)
    deltas = [CountingDelta(make_delta(gen)) for _ in tokens]
    for momentum in ({}, clone(make_master(gen))):
        b0 = clone(momentum)
        report = outer_step(master, momentum, deltas, tokens)
        assert not report.applied
        assert (report.contributors, report.tokens, report.eta_used) == (0, 0, 0.0)
        assert report.shares == [0.0] * len(tokens)
        assert all(torch.equal(master[k], w0[k]) for k in w0)
        assert momentum.keys() == b0.keys()
        assert all(torch.equal(momentum[k], b0[k]) for k in b0)
    assert all(d.reads == {} for d in deltas)


def test_lazy_deltas_are_read_once_each(tmp_path) -> None:
    gen = torch.Generator().manual_seed(8)
    w0 = make_master(gen)
    raw = [make_delta(gen) for _ in range(3)]
    counting = [CountingDelta(d) for d in raw]
    master = clone(w0)
    outer_step(master, {}, counting, [3, 4, 5])
    assert all(d.reads == dict.fromkeys(SHAPES, 1) for d in counting)

    paths = []
    for i, d in enumerate(raw):
        paths.append(tmp_path / f"delta{i}.safetensors")
        save_file(d, str(paths[-1]))
    from_files = clone(w0)
    handles = [safe_open(str(p), framework="pt") for p in paths]
    outer_step(from_files, {}, [SafetensorsDelta(h) for h in handles], [3, 4, 5])
    assert all(torch.equal(from_files[k], master[k]) for k in w0)


def _good_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    return make_master(gen), make_delta(gen)


def _missing(d):
    d.pop("layers.0.attn.wq")


def _extra(d):
    d["layers.9.ghost"] = torch.zeros(3, dtype=torch.bfloat16)


def _shape(d):
    d["embed.weight"] = torch.zeros(96, 24, dtype=torch.bfloat16)


def _fp16(d):
    d["norm.weight"] = d["norm.weight"].half()


def _int(d):
    d["norm.weight"] = torch.zeros(24, dtype=torch.int64)


def _nan(d):
    d["layers.0.mlp.w1"][1, 2, 3] = float("nan")


def _inf(d):
    d["layers.1.mlp.w2"][-1] = float("-inf")


def _not_tensor(d):
    d["layers.0.scale"] = [0.0]


BAD = [
    (_missing, "layers.0.attn.wq", "missing"),
    (_extra, "layers.9.ghost", "unexpected"),
    (_shape, "embed.weight", "shape (96, 24); expected (97, 24)"),
    (_fp16, "norm.weight", "dtype torch.float16"),
    (_int, "norm.weight", "dtype torch.int64"),
    (_nan, "layers.0.mlp.w1", "1 non-finite"),
    (_inf, "layers.1.mlp.w2", "1 non-finite"),
    (_not_tensor, "layers.0.scale", "not a torch.Tensor"),
]


@pytest.mark.parametrize(("spoil", "name", "problem"), BAD)
def test_validate_delta_names_the_tensor_and_problem(spoil, name: str, problem: str) -> None:
    master, delta = _good_pair()
    validate_delta(master, delta)
    validate_delta(master, {k: v.float() for k, v in delta.items()})
    spoil(delta)
    with pytest.raises(DeltaError) as info:
        validate_delta(master, delta)
    assert repr(name) in str(info.value) and problem in str(info.value)
    assert info.value.tensor == name


@pytest.mark.parametrize(("spoil", "name", "problem"), BAD[:5] + BAD[7:])
def test_outer_step_rejects_malformed_deltas(spoil, name: str, problem: str) -> None:
    master, delta = _good_pair()
    spoil(delta)
    with pytest.raises(DeltaError, match=re.escape(problem)):
        outer_step(master, {}, [delta], [1])


def test_key_errors_are_found_before_anything_is_written() -> None:
    master, good = _good_pair()
    w0 = clone(master)
    bad = dict(good)
    bad.pop("norm.weight")
    momentum: dict[str, torch.Tensor] = {}
    with pytest.raises(DeltaError, match="missing"):
        outer_step(master, momentum, [good, bad], [1, 1])
    assert momentum == {} and all(torch.equal(master[k], w0[k]) for k in w0)


def test_bad_state_and_arguments_are_rejected() -> None:
    master, delta = _good_pair()
    with pytest.raises(ValueError, match="2 deltas but 1 token counts"):
        outer_step(master, {}, [delta, delta], [1])
    with pytest.raises(ValueError, match="negative"):
        outer_step(master, {}, [delta, delta], [5, -1])
    with pytest.raises(ValueError, match="kernel"):
        outer_step(master, {}, [delta], [1], kernel="gpu")  # type: ignore[arg-type]
    half = {k: v.half() for k, v in master.items()}
    with pytest.raises(StateError, match="float32"):
        outer_step(half, {}, [delta], [1])
    partial = {"norm.weight": torch.zeros(24)}
    with pytest.raises(StateError, match="missing"):
        outer_step(master, partial, [delta], [1])
    with pytest.raises(ValueError, match="beta"):
        OuterConfig(beta=1.0)
    with pytest.raises(ValueError, match="eta"):
        OuterConfig(eta=0.0)


def test_auto_falls_back_to_eager_when_the_fused_kernel_cannot_compile(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def cannot_compile(width: int):
        raise RuntimeError("fused outer-step kernel unavailable: no compiler")

    monkeypatch.setattr(outer, "_get_fused", cannot_compile)
    monkeypatch.setattr(outer, "_FUSED_MIN_PARAMS", 0)
    master, delta = _good_pair()
    want = clone(master)
    outer_step(want, {}, [delta], [1], kernel="eager")
    with caplog.at_level(logging.WARNING, logger="crossfed.outer"):
        outer_step(master, {}, [delta], [1], kernel="auto")
    assert "using the eager kernel" in caplog.text
    assert all(torch.equal(master[k], want[k]) for k in want)


def test_warm_up_compiles_only_what_a_merge_of_that_size_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled: list[int] = []
    monkeypatch.setattr(outer, "_get_fused", lambda width: compiled.append(width) or max)
    assert outer.warm_up(outer._FUSED_MIN_PARAMS - 1) is False and compiled == []  # eager
    assert outer.warm_up(outer._FUSED_MIN_PARAMS) is True and compiled == [outer._FUSED_ARITY]
    assert outer.warm_up(10**9, kernel="eager") is False and len(compiled) == 1

    def cannot_compile(width: int):
        raise RuntimeError("fused outer-step kernel unavailable: no compiler")

    monkeypatch.setattr(outer, "_get_fused", cannot_compile)
    assert outer.warm_up(10**9) is False and outer.warm_up(10**9, kernel="fused") is False


@pytest.mark.slow
def test_fused_kernel_handles_more_contributors_than_its_arity(small_blocks: None) -> None:
    gen = torch.Generator().manual_seed(10)
    master = make_master(gen)
    momentum = {k: torch.randn(s, generator=gen) * 0.05 for k, s in SHAPES.items()}
    eager_m, eager_b = clone(master), clone(momentum)
    deltas = [make_delta(gen) for _ in range(6)]
    tokens = [5, 1, 9, 2, 6, 5]
    outer_step(master, momentum, deltas, tokens, kernel="fused")
    outer_step(eager_m, eager_b, deltas, tokens, kernel="eager")
    assert max_abs(master, eager_m) <= PIN and max_abs(momentum, eager_b) <= PIN


def test_token_shares() -> None:
    assert token_shares([1, 1, 2]) == [0.25, 0.25, 0.5]
    assert token_shares([0, 7]) == [0.0, 1.0]
    for bad, why in [([], "at least one"), ([3, -1], "negative"), ([0, 0], "zero"),
                     ([1.5], "not an integer"), ([True], "bool")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            token_shares(bad)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=12))
def test_shares_are_proportional_and_sum_to_one(tokens: list[int]) -> None:
    if sum(tokens) == 0:
        with pytest.raises(ValueError):
            token_shares(tokens)
        return
    shares = token_shares(tokens)
    assert abs(sum(shares) - 1.0) <= 1e-12
    assert all(s >= 0 for s in shares)
    biggest = max(range(len(tokens)), key=tokens.__getitem__)
    for n, s in zip(tokens, shares, strict=True):
        assert abs(s * tokens[biggest] - shares[biggest] * n) <= 1e-9 * tokens[biggest]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
    st.integers(min_value=0, max_value=2**31),
)
def test_contributor_order_does_not_matter(tokens: list[int], rnd, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    master = make_master(gen)
    momentum = {k: torch.randn(s, generator=gen) * 0.05 for k, s in SHAPES.items()}
    deltas = [make_delta(gen) for _ in tokens]
    order = list(range(len(tokens)))
    rnd.shuffle(order)
    a_m, a_b = clone(master), clone(momentum)
    b_m, b_b = clone(master), clone(momentum)
    ra = outer_step(a_m, a_b, deltas, tokens)
    rb = outer_step(b_m, b_b, [deltas[i] for i in order], [tokens[i] for i in order])
    assert ra.shares == pytest.approx([rb.shares[order.index(i)] for i in range(len(order))])
    assert max_abs(a_m, b_m) <= 1e-6 and max_abs(a_b, b_b) <= 1e-6
