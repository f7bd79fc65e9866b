"""``crossfed evaluate`` and ``crossfed export``: what is done with a global model."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from crossfed.cmdline import add_config, add_threads, examples, run_config, write_json
from crossfed.config import ConfigError


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Pull the global model of a generation and measure its held-out perplexity."""
    import torch
    from safetensors.torch import load_file

    from crossfed.client.reach import client_for
    from crossfed.data.windows import WindowStore
    from crossfed.train.distributed import DistributedError, resolve_device
    from crossfed.train.inner import evaluate
    from crossfed.train.model import build_model, load_parameters

    config = run_config(args)
    try:
        device = resolve_device(config.eval.device, "eval.device")
    except DistributedError as exc:
        raise ConfigError(str(exc)) from exc
    torch.set_num_threads(args.threads)
    client = client_for(config, "admin")
    t0 = time.perf_counter()
    path = client.download_model(args.generation, Path(args.model_out))
    download_s = time.perf_counter() - t0
    val = WindowStore.open(Path(config.data.dir), "val")
    model = build_model(config.model.flavour, vocab_size=val.vocab_size, device=device)
    load_parameters(model, load_file(str(path), device=device))
    t1 = time.perf_counter()
    loss, ppl = evaluate(
        model,
        val.windows,
        val.n_windows,
        batch=config.eval.batch,
        max_windows=config.eval.max_windows,
        device=device,
    )
    eval_s = time.perf_counter() - t1
    from crossfed.progress import CONSOLE

    CONSOLE.info(
        "round %d/%d global model: held-out loss %.4f, perplexity %.2f (%s, %.1fs)",
        args.generation,
        config.rounds,
        loss,
        ppl,
        device,
        eval_s,
    )
    write_json(
        args.out,
        {
            "generation": args.generation,
            "val_loss": loss,
            "val_perplexity": ppl,
            "eval_s": eval_s,
            "download_s": download_s,
            "device": device,
        },
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a global model in the Hugging Face layout, as ``save_pretrained`` would."""
    from safetensors.torch import load_file

    from crossfed.data.windows import read_meta
    from crossfed.moments import without_moments
    from crossfed.train.export import ExportError, export_hf

    config = run_config(args)
    model = Path(args.model) if args.model else None
    if model is None:
        found = sorted(
            Path(config.results).glob("checkpoints/global-*.safetensors"),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]),
        )
        if not found:
            raise ConfigError(f"no global model under {config.results}/checkpoints; use --model")
        model = found[-1]
    if not model.exists():
        raise ConfigError(f"model file not found: {model}")
    data = Path(config.data.dir)
    meta = read_meta(data)
    tokenizer = data / "tokenizer.json"
    try:
        out = export_hf(
            without_moments(load_file(str(model))),
            config.model.flavour,
            int(meta["vocab_size"]),
            Path(args.out),
            seq_len=int(meta["seq_len"]),
            eos_id=int(meta["eos_id"]),
            dtype=args.dtype,
            tokenizer=tokenizer if tokenizer.exists() else None,
        )
    except ExportError as exc:
        raise ConfigError(str(exc)) from exc
    print(
        f"exported {model} as a Hugging Face Qwen3 model to {out} (context {meta['seq_len']}, "
        f"eos id {meta['eos_id']}); load it with AutoModelForCausalLM.from_pretrained({str(out)!r})"
    )
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``evaluate`` (alias ``checkpoint``) and ``export`` on the crossfed parser."""
    ckpt = sub.add_parser(
        "evaluate",
        aliases=["checkpoint"],  # its first name, kept for scripts that use it
        help="pull a global model and evaluate it",
        description="Download a generation's global model and measure its held-out loss and "
        "perplexity\n(eval.max_windows windows of the validation split, on eval.device).",
        epilog=examples(
            "crossfed evaluate --config config/config.yaml --generation 3 \\",
            "    --model-out results/checkpoints/global-3.safetensors --out eval.json",
        ),
    )
    add_config(ckpt)
    ckpt.add_argument(
        "--generation",
        type=int,
        required=True,
        help="the global model's generation: the round that made it (0: the initial model)",
    )
    ckpt.add_argument("--model-out", required=True, help="where to keep the model (safetensors)")
    add_threads(ckpt)
    ckpt.add_argument("--out", help="write the evaluation (JSON) here (default: print it)")
    ckpt.set_defaults(func=cmd_checkpoint)

    export = sub.add_parser(
        "export",
        help="a global model in Hugging Face format",
        description="Write a global model as a Hugging Face Qwen3 checkpoint, the files "
        "save_pretrained writes:\nmodel.safetensors, config.json, generation_config.json "
        "(generate stops at end of text),\ntokenizer.json and tokenizer_config.json "
        "(model_max_length: the trained seq_len).\ntransformers' AutoModelForCausalLM and "
        "AutoTokenizer load the folder.",
        epilog=examples(
            "crossfed export --config config/config.yaml --out hf-model",
            "crossfed export --model results/checkpoints/global-4.safetensors --out hf-model-4 "
            "--dtype float32",
        ),
    )
    add_config(export)
    export.add_argument("--model", help="global model safetensors (default: the newest checkpoint)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the exported weights",
    )
    export.set_defaults(func=cmd_export)
