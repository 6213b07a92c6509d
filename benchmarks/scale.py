"""Models as big as the nodes hold: the driver's memory stays flat from 135M to ≈3B parameters while
its nodes load bf16 weights themselves (model.source auto, model.dtype bf16).

    python -m benchmarks.scale [--sizes 135M 0.5B 1.5B 3B] [--strategies spsa lofi] [--steps 3]
                               [--out runs/bench/scale.json]

For each size it writes a random-init Llama checkpoint (bf16 safetensors, sharded, from a config;
135M is the bundled SmolLM2-135M, loaded as bf16) with the bundled SmolLM2 tokenizer into a temp
folder, then runs each strategy with LoRA (r=8 on q_proj, v_proj) on 2 nodes for `--steps` steps of
2 sequences of 32 tokens of Hamlet, each run a fresh `raylowcomm.runner.run` in its own process (a
fresh local Ray). Per run: the driver's peak RSS, each node's peak RSS ÷ the bf16 weight bytes, its
resident memory before the model loads and (peak − that) ÷ the weight bytes (what the model, the
imports made while loading it, such as transformers' model classes, and the run add to the process),
setup bytes per node (the data recipe, which carries the tokenizer, shown apart), and mean step
time. No accuracy is claimed: the weights are random. A benchmark: it reports figures, it asserts none.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1024 * 1024
SIZES = {  # Llama shapes (SmolLM2's 49,152-token vocabulary, tied embeddings); ≈ parameters
    "0.5B": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "1.5B": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "3B": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
    },
}
SHARD_BYTES = 1 << 30


def write_checkpoint(size: str, out: Path) -> Path:
    """A Hugging Face folder: config.json, bf16 weights drawn N(0, 0.02) (norms 1) in ~1 GB shards with
    their index, and SmolLM2's tokenizer. Tensors are drawn one at a time: the writer holds one shard."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from raylowcomm import assets

    smol = assets.require("SmolLM2-135M")
    base = json.loads((smol / "config.json").read_text())
    config = LlamaConfig(
        **{
            k: base[k]
            for k in (
                "vocab_size",
                "bos_token_id",
                "eos_token_id",
                "pad_token_id",
                "rope_parameters",
                "max_position_embeddings",
                "rms_norm_eps",
            )
        },
        tie_word_embeddings=True,
        **SIZES[size],
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for f in smol.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    gen, shard, index, total = torch.Generator().manual_seed(0), {}, {}, 0

    def flush():
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard.clear()

    for key, shape in shapes.items():
        tensor = torch.ones(shape) if "norm" in key else torch.empty(shape).normal_(0, 0.02, generator=gen)
        shard[key] = tensor.to(torch.bfloat16)
        total += shard[key].numel() * 2
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    return out


def config(model: str, strategy: str, steps: int, out: Path):
    from raylowcomm.strategies import from_dict

    return from_dict(
        {
            "model": {
                "name": model,
                "family": "hf_causal_lm",
                "dtype": "bf16",
                "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            },
            "data": {"name": "hamlet", "train_size": 4 * steps, "test_size": 4, "max_length": 32, "shift": "none"},
            "optim": {"name": "adamw", "lr": 1e-4, "batch_size": 2, "max_steps": steps, "eval_batch_size": 2},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": [strategy],
            "log_every": 1,
            "checkpoint_every": 1000,
            "out_dir": str(out),
            "spsa": {"steps": steps, "verify_every": steps},
        }
    )


def child(args) -> None:
    """One run in this fresh process; prints its figures as one RESULT line."""
    from raylowcomm.common.timing import peak_rss_bytes
    from raylowcomm.runner import run

    t0 = time.perf_counter()
    [rec] = run(config(args.model, args.strategy, args.steps, Path(args.work)), bar=False)
    if "error" in rec:
        raise SystemExit(f"{args.strategy} failed: {rec['error']}")
    kinds = rec["comm"]["by_kind"]
    nodes = [n for n in rec["nodes"] if n.get("peak_rss_bytes")]
    print(
        "RESULT "
        + json.dumps(
            {
                "driver_peak_mb": peak_rss_bytes() / MB,  # VmHWM: ru_maxrss would keep this process's parent's peak
                "node_peak_mb": [n["peak_rss_bytes"] / MB for n in nodes],
                "node_before_model_mb": [n["rss_before_model_bytes"] / MB for n in nodes],
                "setup_bytes": rec["comm"]["by_phase"]["setup"],
                "data_recipe_bytes": kinds.get("setup/data_recipe", 0),
                "model_recipe_bytes": kinds.get("setup/model_recipe", 0),
                "initial_weights_bytes": kinds.get("setup/initial_weights", 0),
                "step_s": rec["train_s"] / args.steps,
                "wall_s": time.perf_counter() - t0,
            }
        ),
        flush=True,
    )


def run_child(model: str, strategy: str, steps: int, work: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "RAY_AUTH_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.scale",
        "--child",
        "--model",
        model,
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        "--work",
        str(work),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{strategy} on {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def table(results: list[dict]) -> str:
    results = [r for r in results if "error" not in r]
    header = [
        "model",
        "params",
        "strategy",
        "weights MB",
        "driver peak MB",
        "node peak / weights",
        "node before model MB",
        "(peak - before) / weights",
        "setup B/node (w/o data recipe)",
        "data recipe B/node",
        "step s",
    ]
    rows = [
        [
            r["size"],
            f"{r['params'] / 1e9:.2f}B",
            r["strategy"],
            f"{r['weight_bytes'] / MB:,.0f}",
            f"{r['driver_peak_mb']:,.0f}",
            " ".join(f"{p * MB / r['weight_bytes']:.2f}" for p in r["node_peak_mb"]),
            " ".join(f"{b:,.0f}" for b in r["node_before_model_mb"]),
            " ".join(
                f"{(p - b) * MB / r['weight_bytes']:.2f}" for p, b in zip(r["node_peak_mb"], r["node_before_model_mb"])
            ),
            f"{(r['setup_bytes'] - r['data_recipe_bytes']) / 2:,.0f}",
            f"{r['data_recipe_bytes'] / 2:,.0f}",
            f"{r['step_s']:.1f}",
        ]
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [header] + rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["135M", *SIZES], choices=["135M", *SIZES])
    parser.add_argument("--strategies", nargs="+", default=["spsa", "lofi"], choices=["spsa", "lofi"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/scale.json", help="the JSON to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.write:
        write_checkpoint(args.write, Path(args.work))
        return None
    from raylowcomm import assets

    results, path = [], Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="scale_") as tmp:
        for size in args.sizes:
            model = assets.require("SmolLM2-135M") if size == "135M" else Path(tmp) / size
            if size != "135M":  # in a process of its own: this one stays small while the runs go
                subprocess.run(
                    [sys.executable, "-m", "benchmarks.scale", "--write", size, "--work", str(model)],
                    check=True,
                    cwd=Path(__file__).resolve().parent.parent,
                )
            index = model / "model.safetensors.index.json"
            params = (
                json.loads(index.read_text())["metadata"]["total_size"] // 2
                if index.exists()
                else (model / "model.safetensors").stat().st_size // 4
            )  # the asset is fp32 on disk
            for strategy in args.strategies:
                try:
                    row = run_child(str(model), strategy, args.steps, Path(tmp) / f"run_{size}_{strategy}")
                    print(
                        f"  {size} {strategy}: driver peak {row['driver_peak_mb']:,.0f} MB, node peaks "
                        f"{[round(p) for p in row['node_peak_mb']]} MB, step {row['step_s']:.1f} s",
                        flush=True,
                    )
                except RuntimeError as err:  # e.g. Ray's OOM killer on a shared machine: said, and the rest run
                    row = {"error": str(err)[-2000:]}
                    print(f"  {size} {strategy}: FAILED {str(err).splitlines()[0]}", flush=True)
                row.update(size=size, strategy=strategy, params=params, weight_bytes=2 * params)
                results.append(row)
                path.write_text(json.dumps({"benchmark": "scale", "steps": args.steps, "results": results}, indent=2))
            if size != "135M":
                shutil.rmtree(model)
    print("\n" + table(results))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
