"""What a peer round costs a node's CPU, part by part, for a config's model: Δ in float64, its encoding
with error feedback, the average of N decoded payloads, the outer step, the round file and the
checkpoint. The link's time is not here (`raylowcomm plan` models it); this is the work a node does
around it, which a slow CPU or a large model pays every round.

    python -m benchmarks.round_cost [CONFIG] [--codec int8] [--nodes 2] [--classes 10] [--repeat 5]
                                    [--scale node|shared] [--secure]

With `--secure` (lofi.secure: `--scale shared`, 3 nodes or more) the average is of masked payloads, and
a node's masking of its payload and its key agreement (once a run, not a round's) are timed too.

Times are the shortest of `--repeat` calls on one torch thread, a node's share of a CPU. Prints a table. A
benchmark: it reports figures, it asserts none.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from raylowcomm.common.timing import best_of
from raylowcomm.core.secagg import Roster, SecAggNode
from raylowcomm.models import load_base
from raylowcomm.storage import Storage
from raylowcomm.strategies import load_config
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.strategies.lofi.payload import DeltaCodec, floats
from raylowcomm.strategies.lofi.round_file import write_round

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)


def measure(
    config: Path, codec: str, nodes: int, classes: int, repeat: int, scale: str = "node", secure: bool = False
) -> dict[str, float]:
    cfg = load_config(config, [f"lofi.compress={codec}", f"lofi.compress_scale={scale}"])
    model = load_base(cfg.model, classes, cfg.seed)[0]
    state = model.state_dict()
    params = {n for n, p in model.named_parameters() if p.requires_grad}
    deltas = DeltaCodec(Lofi.opts(cfg), state, params)
    weights = {k: v for k, v in floats(state).items() if k in params}
    draw = torch.Generator().manual_seed(0)
    moved = {k: v + 1e-3 * torch.randn(v.shape, generator=draw, dtype=v.dtype) for k, v in weights.items()}

    def delta_of() -> dict:
        return {k: w.to(torch.float64, copy=True).sub_(moved[k]) for k, w in weights.items()}  # as `NodeRounds._delta`

    def outer_step() -> dict:
        return {k: weights[k].to(torch.float64, copy=True).sub_(d).to(weights[k].dtype) for k, d in mean.items()}

    delta = delta_of()
    payloads = [deltas.encode(delta) for _ in range(nodes)]
    mean = deltas.average(payloads, [1.0] * nodes)
    residual = {k: v.clone() for part in deltas.feedback for k, v in part.residual.items()}
    averaging = _secure_parts(deltas, payloads, repeat) if secure else {}
    if not secure:
        averaging[f"average {nodes}"] = best_of(lambda: deltas.average(payloads, [1.0] * nodes), repeat)
    with tempfile.TemporaryDirectory(prefix="round_cost_") as folder:
        storage = Storage(folder)
        return {
            "delta": best_of(delta_of, repeat),
            "encode": best_of(lambda: deltas.encode(delta), repeat),
            **averaging,
            "outer step": best_of(outer_step, repeat),
            "round file": best_of(lambda: write_round(storage, "round.st", 1, weights, None, residual), repeat),
            "checkpoint": best_of(lambda: storage.save_tensors("model.safetensors", dict(state)), repeat),
        }


def _secure_parts(deltas: DeltaCodec, payloads: list, repeat: int) -> dict[str, float]:
    """A secure round's own parts: node 0's key agreement with the others (once a run), its masking, and the
    average of every node's masked payload, as `node_secure` does them."""
    nodes, members = len(payloads), list(range(len(payloads)))
    keys = {k: SecAggNode(k) for k in members}
    roster = Roster("round_cost", {k: node.public for k, node in keys.items()})
    for node in keys.values():
        node.join(roster)
    masked = [deltas.mask(payloads[k], False, keys[k], "round=1", members, nodes) for k in members]
    return {
        "keys (a run)": best_of(lambda: SecAggNode(0, keys[0]._private).join(roster), repeat),
        "mask": best_of(lambda: deltas.mask(payloads[0], False, keys[0], "round=1", members, nodes), repeat),
        f"secure average {nodes}": best_of(lambda: deltas.average_masked(masked, False, nodes), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", type=Path, default=ROOT / "examples" / "wan_compare.yaml")
    parser.add_argument("--codec", default="int8", help="lofi.compress: none | int8 | int4 | int2 | topk | sign")
    parser.add_argument("--nodes", type=int, default=2, help="payloads a round averages")
    parser.add_argument("--classes", type=int, default=10, help="the new head's outputs")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scale", default="node", help="lofi.compress_scale: node | shared")
    parser.add_argument("--secure", action="store_true", help="lofi.secure: masked payloads (--scale shared)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    parts = measure(args.config, args.codec, args.nodes, args.classes, args.repeat, args.scale, args.secure)
    how = f"{args.scale} scales{', secure' if args.secure else ''}"
    logger.info("%s, %s (%s), %d nodes: seconds a round on one thread", args.config.name, args.codec, how, args.nodes)
    for name, seconds in parts.items():
        logger.info("  %-12s %.4f", name, seconds)
    logger.info("  %-12s %.4f", "total", sum(v for k, v in parts.items() if k != "keys (a run)"))


if __name__ == "__main__":
    main()
