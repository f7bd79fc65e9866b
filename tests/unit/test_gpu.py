"""A site round on the GPU against a real coordinator: bf16 autocast and flex attention in
training, the checkpoint of device state, the delta upload, then the held-out evaluation of
the merged model on the GPU agreeing with the CPU's.

The same checks run on the CPU everywhere (so they stay true) and on ``cuda`` where torch
sees a GPU (skipped elsewhere).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from crossfed.config import load_run_config, load_sites
from crossfed.data.windows import WindowStore
from crossfed.site import SiteRunner
from crossfed.site.job import site_settings
from crossfed.train import checkpoint
from crossfed.train.inner import evaluate
from crossfed.train.model import build_model, load_parameters
from tests.conftest import LiveCoordinator
from tests.unit.test_site_inner import init, site_config

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_a_site_round_on_the_device_commits_and_its_model_evaluates_alike(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, device: str
) -> None:
    init(coordinator, tiny_data)
    path = site_config(tmp_path, coordinator, tiny_data)
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"device": device}
    path.write_text(yaml.safe_dump(raw))
    config = load_run_config(path)
    sites = load_sites(config)
    settings = site_settings(config, "snellius", sites["snellius"])
    runner = SiteRunner(settings, coordinator.client("snellius"))
    outcome = runner.run_round(1)
    assert outcome.status == "accepted", outcome.detail
    assert outcome.steps == 4 and outcome.blocks_committed == outcome.blocks_leased == 2
    assert math.isfinite(outcome.loss_mean) and outcome.tokens_per_s > 0
    assert runner.model is not None
    assert next(runner.model.parameters()).device.type == device.split(":")[0]
    if device.startswith("cuda"):
        assert outcome.mfu is not None and 0 < outcome.mfu < 1
    cursor = checkpoint.latest(tmp_path / "results" / "sites" / "snellius" / "state")
    assert cursor is not None and cursor["status"] == "done"

    admin, deadline = coordinator.client(), time.monotonic() + 60
    while admin.round_info(1)["status"] != "closed":  # snellius alone: the round closes
        assert time.monotonic() < deadline, admin.round_info(1)
        time.sleep(0.2)
    model_path = admin.download_model(1, tmp_path / "global-1.safetensors")
    weights = load_file(str(model_path))
    val = WindowStore.open(tiny_data, "val")
    results = {}
    for where in ("cpu", device):
        model = build_model("tiny", vocab_size=val.vocab_size, device=where)
        load_parameters(model, {k: v.to(where) for k, v in weights.items()})
        results[where] = evaluate(model, val.windows, val.n_windows, max_windows=32, device=where)
    (cpu_loss, _), (dev_loss, dev_ppl) = results["cpu"], results[device]
    assert math.isfinite(dev_ppl) and abs(dev_loss - cpu_loss) < 1e-3, results
