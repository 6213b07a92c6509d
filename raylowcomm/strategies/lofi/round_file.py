"""The round file: one safetensors file per node beside its model checkpoint (`round_path`),
written before it, holding what the node keeps for its rounds: the last global model, the outer
momentum and the error-feedback residual (float64), with the round number, the fragment the round
synced and the mix it was merged with. A node restarted from its checkpoints continues exactly; one
that died between the two writes finds the newer round here and merges it again. Node 0 (or the
driver, in star rounds) also writes the global model and momentum to `GLOBAL`, the run's result so
far, in the same format."""

from __future__ import annotations

from raylowcomm.strategies.lofi.streaming import ALL

GLOBAL = "lofi/global.safetensors"
"""The last averaging round's global model (and outer momentum): what a resumed run starts from."""


def round_path(rank: int) -> str:
    return f"lofi/checkpoints/node{rank}_round.safetensors"


def write_round(
    storage,
    path: str,
    round_: int,
    state: dict,
    momentum: dict | None = None,
    residual: dict | None = None,
    nodes: list[dict] | None = None,
    sent: dict | None = None,
    **meta,
) -> None:
    """A round's state as one safetensors file: `global.*`, `momentum.*` (with an outer step) and
    `residual.*` (a node's error feedback), per tensor, so per fragment too; with the round number
    (and `meta`: which fragment the round synced, how it was mixed in); `read_round` reads it back.
    `nodes`: where rounds merge (LoRA), every node's decoded state of the round, `node_states` reads them.
    `sent`: where a node keeps what it trained while its round was in flight (`lofi.keep_training` with
    overlap), the parameters it sent from, so that a restart merges the round again exactly (`sent_weights`)."""
    parts = {
        "global": state,
        "momentum": momentum or {},
        "residual": residual or {},
        "sent": sent or {},
        **{f"node{k}": values for k, values in enumerate(nodes or [])},
    }
    tensors = {f"{part}.{k}": v for part, values in parts.items() for k, v in values.items()}
    storage.save_tensors(path, tensors, {"round": round_, **meta})


def read_round(storage, path: str) -> tuple[dict, dict, dict, int]:
    """(global, momentum, residual, round) as `write_round` wrote them (empty parts where it had none)."""
    tensors, meta = storage.load_tensors(path)
    parts = {
        p: {k[len(p) + 1 :]: v for k, v in tensors.items() if k.startswith(p + ".")}
        for p in ("global", "momentum", "residual")
    }
    return parts["global"], parts["momentum"], parts["residual"], meta["round"]


def node_states(storage, path: str) -> list[dict]:
    """The nodes' decoded states a round file holds (`write_round`'s `nodes`), in node order."""
    tensors, parts = storage.load_tensors(path)[0], {}
    for key, v in tensors.items():
        part, name = key.split(".", 1)
        if part.startswith("node") and part[4:].isdigit():
            parts.setdefault(int(part[4:]), {})[name] = v
    return [parts[k] for k in sorted(parts)]


def round_meta(storage, path: str) -> dict:
    """What `write_round` wrote besides the tensors: the round, the fragment it synced (ALL: every
    tensor) and the mix it was merged with."""
    return {"fragment": ALL, "mix": 0.0, **storage.load_tensors(path)[1]}


def sent_weights(storage, path: str) -> dict:
    """The parameters a node sent its round's payload from (`write_round`'s `sent`); empty where none."""
    tensors = storage.load_tensors(path)[0]
    return {k[len("sent.") :]: v for k, v in tensors.items() if k.startswith("sent.")}
