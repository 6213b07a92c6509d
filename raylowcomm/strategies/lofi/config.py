"""lo-fi's options (`lofi:` in a config): what averages when, how rounds travel and what they compress.
Flat, as the YAML has them; `options.LofiOptions` groups them by what they set, and each group checks
its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raylowcomm.config import RunConfig
from raylowcomm.core.membership import JoinEvent, LeaveEvent

NAME = "lofi"
"""The strategy's name, and its section in a config (`lofi:`)."""

MAX_COMPRESS_BLOCK = 65536
"""lofi.compress_block's upper bound: every node pads each tensor to whole blocks."""


@dataclass
class PrivacyConfig:
    """`lofi.privacy`: distributed differential privacy of peer rounds (docs/privacy.md)."""

    epsilon: float | None = None
    """The ε the run's rounds may spend, at `delta` (> 0): a config whose rounds would spend more is refused."""
    delta: float = 1.0e-5
    """δ of the (ε, δ) guarantee, in (0, 1): well below 1 / the number of nodes."""
    clip: float = 1.0
    """C: each node's round Δ is scaled to L2 norm at most this (over all its tensors) before its noise."""
    noise: float | None = None
    """σ, the noise multiplier: each node adds Gaussian noise of σ·C/√N per entry, so that the N nodes'
    sum carries σ·C. None: the smallest σ whose ε over the run's rounds fits `epsilon`."""


@dataclass
class LofiConfig:
    average_every: int | list[int] | None = None
    """Average and re-broadcast every this many `average_unit`s; None = lo-fi, once at the end. A list is
    a schedule: the gaps between successive rounds, its last entry repeating to the end of the run
    ([2, 4, 8, 16]: H growing as the nodes drift apart less). A list of equal entries is the number."""
    warmup_steps: int = 0
    """Steps at the start after each of which the nodes average (post-local SGD's warm-up, while a new
    head and BatchNorm statistics drift apart fastest), before `average_every` takes over: one round's
    bytes per step. Needs average_every."""
    average_unit: Literal["steps", "epochs"] = "steps"
    """What average_every counts: optimizer steps, or epochs of the smallest shard."""
    outer_optimizer: Literal["none", "nesterov"] = "none"
    """nesterov: DiLoCo's outer SGD with Nesterov momentum on the averaged update."""
    outer_lr: float = 0.7
    """The outer step's learning rate (outer_optimizer: nesterov; DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """The outer step's Nesterov momentum (DiLoCo's 0.9)."""
    weighting: Literal["uniform", "examples"] = "uniform"
    """uniform: every node counts the same in the average; examples: by its number of training examples."""
    soup: Literal["uniform", "greedy"] = "uniform"
    """greedy: add a node's model only if the held-out (data.val_size) score does not drop."""
    bn_recalibrate: bool = True
    """Recompute BatchNorm statistics of the average on every node's shard (BN models only)."""
    bn_batches: int | None = None
    """Batches per node for the BN statistics (None: one pass over the shard)."""
    lora_average: Literal["delta", "factors"] = "delta"
    """With model.lora, nodes send adapters only. delta: the exact average of what they learned,
    base + mean_k (alpha/r)·B_k·A_k, merged; factors: mean(B)·mean(A), FedAvg of the factors, to compare.
    After an averaging round every node merges the average into its base and restarts its adapters
    from one seeded initialisation (a new one each round), so replicas start each round identical."""
    exchange: Literal["auto", "driver", "peers"] = "auto"
    """How averaging rounds travel. driver: full weights, every node to the driver and the average back
    (a star; with `secure`, masked codes up and their sum back); peers: each node puts its outer gradient
    Δ = θ_global − θ_k (encoded by `compress`) in the object store, every node fetches its peers' and
    averages them itself, bit-identical (hash-checked),
    and the final average is taken from the nodes' compressed Δ; auto: peers when compress is set, else
    driver. With model.lora the adapters' and head's Δ cross and every node merges the exact
    average into its own base. Not with soup: greedy."""
    compress: Literal["none", "int8", "int4", "int2", "topk", "sign"] = "none"
    """Codec of the outer gradients in peer rounds: none (their float32 bytes), int8, int4 or int2 (blockwise
    absmax-scaled; int2 is ternary, 2.25 bits a weight at compress_block 64), topk (the topk_fraction
    largest entries per tensor, int4 values, an index in about
    1 + 1/(255·topk_fraction) bytes, 2 in tensors sparser than 0.4%), sign (every entry ± its block's
    mean |Δ|: a bit a weight and a bf16 scale a block, 1.25 bits a weight at compress_block 64)."""
    topk_fraction: float = 0.01
    """compress: topk: the fraction of each tensor's entries sent."""
    dense: list[str] = field(default_factory=list)
    """Parameters whose Δ crosses whole every round in `dense_codec` instead of `compress`: `head` (the new
    head), `vectors` (every 1-D parameter: biases and norm weights), or shell patterns on parameter names
    (`classifier.*`). Top-k moves each tensor by its largest few percent a round; a new head learns most
    early, so a short run's rounds leave it behind. Costs those tensors' dense bytes every round."""
    dense_codec: Literal["none", "int8", "int4", "int2"] = "int8"
    """The codec of `dense`'s tensors (with error feedback like the rest)."""
    compress_block: int = 64
    """Entries per bf16 scale for int8/int4/int2/topk/sign values (at most 65536)."""
    compress_scale: Literal["node", "shared"] = "node"
    """The grid int8/int4/int2 codes decode on. node: each node's own bf16 scale per block. shared: each node
    sends its codes and scales as node does, and a round decodes every node's codes of a block at the mean
    of the nodes' scales: the nodes' codes then add as plain integers and a round's sum decodes with one
    multiply a block, what secure aggregation (`secure`) needs to mask them. Error feedback keeps what the
    shared grid misses. The same bytes as node. Needs compress (and dense_codec where dense is set) int8,
    int4 or int2, in lockstep peer rounds that take the mean (docs/strategies/lofi.md)."""
    error_feedback: bool = True
    """Each node adds what compression dropped to its next Δ (a float64 residual, checkpointed with the
    node): nothing is lost, only delayed."""
    fragments: int = 1
    """Peer rounds (Streaming DiLoCo): fragment f of this many syncs alone at the steps ≡ (f+1)·H/fragments
    (mod H), H = average_every in steps, divisible by it: 1/fragments of the bytes per sync."""
    overlap: int = 0
    """Peer rounds: steps a node trains on while a round is in flight (at most average_every/fragments)."""
    probe_steps: int = 0
    """Before the nodes split, each trains the new head alone for this many steps on its own shard and the
    nodes average the heads (LP-FT): fine-tuning starts from one briefly trained head, not a random one.
    Costs the head's bytes twice per node and `probe_steps` cheap steps (no backward through the body).
    Full fine-tuning of a classifier (timm, hf_classifier) only; an outer step needs peer rounds with it."""
    final_round: Literal["compressed", "int8", "exact"] = "compressed"
    """Peer rounds: the codec of the final round, which leaves the average. compressed: `compress`, with
    error feedback (what it drops of Δ and of the residual stays on the nodes, unused); int8: Δ plus the
    whole residual as dense blockwise int8 (about 1 byte a weight per payload); exact: Δ plus the
    residual in float32 (4 bytes a weight): nothing compression held back is lost at the end."""
    final_residual: bool = True
    """Peer rounds with error feedback: whether the final round adds the residual (what compression held
    back over the run) to the last Δ. false: the final round sends the last Δ alone and the residual is
    dropped, as an exact average of the nodes' models would."""
    mix: float = 0.0
    """With overlap, a landed fragment's weights on a node: mix·its own + (1 − mix)·the global ones
    (0 with model.lora)."""
    round_momentum: Literal["keep", "reset"] = "keep"
    """What a node's optimizer state does when a round's global model lands. keep: its own momentum (and
    Adam's moments) go on from its own steps; reset: they start afresh from the global model, as the
    other nodes' do: no node keeps pulling toward where its own steps went. Costs no byte."""
    sync: Literal["steps", "time"] = "steps"
    """When a node sends its round's payload. steps: at the `average_every` boundaries; time: at the step
    end nearest to `sync_every_s` seconds of its own training, however many steps that is (a fast node is
    never held back), each Δ weighted by the examples it trained on since its last round. Time sync runs
    on quorum rounds (`quorum` null: every live node)."""
    sync_every_s: float | None = None
    """sync: time: the seconds of training between a node's payloads."""
    quorum: int | float | None = None
    """Peer rounds that never wait for every node: a round lands once this many nodes' payloads are in
    (a whole number, at most the live nodes), or this fraction of the live nodes' (a float in (0, 1];
    a node restarting is not live until it rejoins), and either every live node's payload arrived or
    `grace_s` passed. A payload that missed its round is merged into a later one (see `staleness`).
    None: every round waits for every node (lockstep)."""
    grace_s: float = 0.0
    """Quorum rounds: seconds a round waits, once its quorum is in, for the other live nodes; only for
    those its last segment's pace says will arrive within it (a node far behind is not waited for)."""
    staleness: float = 0.5
    """Quorum rounds: a payload that missed τ rounds counts with weight w·(1 + τ)^-staleness in the
    round that merges it (w: its node's weight, `weighting`; with sync: time, the examples it trained
    on); 0: as much as a fresh one."""
    keep_training: bool = False
    """Quorum rounds: a node whose payload waits for its round trains on instead of waiting (at most two
    of its payloads wait at once); when the round lands, its model moves onto the new global model with
    what it trained since on top (docs/strategies/lofi.md). False: it waits, and with every node on time
    and `quorum` every node, the rounds are lockstep rounds bit for bit. With `overlap`: when a round
    lands, the τ steps a node trained while it was in flight stay on top of the new global model
    (θ ← θ_global + (θ − θ_sent)) instead of being dropped (`mix` 0) or mixed; they cross in its next
    payload. Not with model.lora."""
    join: list[JoinEvent] = field(default_factory=list)
    """Nodes that join quorum rounds, [{step}]: the i-th, node nodes.count + i, starts once the run has
    trained `step` steps (its node-steps over nodes.count), from the latest global model a node holds
    (its round file in `storage`), and lands the rounds after it at its first segment. The training set
    has one shard per node slot (nodes.count + len(join)): a joiner trains its own shard from then on."""
    leave: list[LeaveEvent] = field(default_factory=list)
    """Nodes that leave quorum rounds, [{node, step}]: node k trains to its own step `step`, its last
    payload merges into the next round, and its actor ends; its shard is not trained after that. how:
    remove only (a crash is `churn.kill` with nodes.max_restarts: 0)."""
    aggregate: Literal["mean", "clip", "trimmed_mean", "median"] = "mean"
    """How a peer or quorum round combines the nodes' decoded Δ, every round including the final one
    (docs/robust.md). mean: the weighted mean, bit for bit as without this field; clip: each node's Δ
    scaled down to at most clip_kappa × the round's median norm, then the mean (bounds how far one node
    moves the model); trimmed_mean: per coordinate, the trim fraction of the weight dropped from each end,
    then the mean; median: the weighted median per coordinate. Quorum rounds' staleness weights are the
    rules' weights. A top-k coordinate a node did not send counts as 0 (so the coordinate rules mostly
    zero a top-k round). Peer rounds only (not the driver's star, not model.lora)."""
    clip_kappa: float = 2.0
    """aggregate: clip: κ, the bound on a node's Δ norm in units of the round's median norm (> 0)."""
    trim: float = 0.25
    """aggregate: trimmed_mean: β in [0, 0.5), the fraction of the round's weight dropped at each end of
    every coordinate (with equal weights ⌊β·N⌋ nodes a side)."""
    on_bad_payload: Literal["fail", "drop"] = "fail"
    """A payload that cannot be combined. fail: a non-finite Δ stops the run (its node's codec refuses
    it); drop: a node whose Δ is not finite sends a marker instead, and every node leaves it (and any
    decoded payload with a non-finite entry; with a robust aggregate, any whose norm passes
    bad_norm_factor × the round's median norm) out of that round, with a warning naming the node and the
    round in the node's log. Peer rounds only."""
    bad_norm_factor: float = 10.0
    """on_bad_payload: drop with a robust aggregate: a payload whose norm passes this many times the
    round's median norm is dropped from the round (≥ 1)."""
    bad_cosine_factor: float | None = None
    """on_bad_payload: drop with a robust aggregate, 3 or more nodes: a payload whose cosine to the round's
    coordinate-wise median falls below this fraction of the nodes' median cosine is dropped from the round
    (in (0, 1]; 0.5 is a start): a wrong direction (wrong labels, a sign flip or noise at an ordinary norm).
    Among few nodes an honest node's cosine can fall below it too (docs/robust.md). None: no cosine
    screen."""
    dial: Literal["auto", "off"] = "off"
    """auto: the codec, period, dense tensors, block and final round chosen for the run, before any actor
    starts, by the measured rule (the decision table of docs/strategies/lofi.md, `dial.RULES`) from the
    model's kind and the run's steps a node; the settings given here win. The choice and its reason are
    logged and kept in the record (`details.dial`). off: the options as given."""
    dial_bytes: float = 0.01
    """dial: auto: the bytes lo-fi's rounds may move after setup, as a fraction of DDP's gradient
    all-reduce on the same run; a choice over it steps down (a longer period, then a cheaper codec)."""

    privacy: PrivacyConfig | None = None
    """Distributed differential privacy ({epsilon, delta, clip, noise}): each node clips its round Δ to
    `clip` in L2 and adds Gaussian noise before it encodes; ε over the run's rounds from opacus's RDP
    accountant, in the log and the record (`details.privacy`). Peer rounds in lockstep only
    (docs/privacy.md). None: off."""

    secure: bool = False
    """Secure aggregation of peer rounds: each node masks its summable codes (`compress_scale: shared`) with
    pairwise masks agreed by X25519 keys, so that no peer and not the driver reads any node's update, only
    the round's sum, which lands the same model to the bit as without masks. Costs ceil(log2 N) more bits an
    entry and 50-odd bits a block; a node lost after masking: the round is masked again among the others.
    Lockstep peer rounds, 3 nodes or more (docs/privacy.md); with `exchange: driver`, the driver adds the
    masked payloads and sends every node the sum (N payloads up, N sums down). false: rounds in the clear."""

    dial_record = None
    """Not an option: with dial: auto, the choice made for the run (`dial.resolve`), for the record."""
    privacy_plan = None
    """Not an option: with privacy, the σ and rounds resolved for the run (`privacy.PrivacyPlan`)."""


def node_slots(cfg: RunConfig, o) -> int:
    """Node slots, one training shard each: the first nodes (node 0 to `nodes.count` - 1), the joiners
    (lofi.join) after them, and last a range's nodes past its min (`nodes.count: [min, max]`). `o`: the
    `LofiConfig`, or its `QuorumOptions` (`option_groups`), as for the helpers below."""
    return cfg.nodes.most + len(o.join)


def on_quorum(o, elastic: bool = False) -> bool:
    """Whether the rounds land on a quorum (`quorum`, sync by time, or a membership that changes: on a
    schedule, or as the cluster holds nodes, `elastic`)."""
    return o.quorum is not None or o.sync == "time" or bool(o.join or o.leave) or elastic


def fixed_period(o) -> bool:
    """Whether rounds come every H `average_unit`s (a number, no warm-up): what fragments and overlap need."""
    return isinstance(o.average_every, int) and not o.warmup_steps


def round_gaps(o, per_epoch: int) -> list[int] | None:
    """The steps between successive rounds, the last repeating (None: no rounds): the warm-up's single
    steps, then average_every's entries in steps."""
    if o.average_every is None:
        return None
    every = o.average_every if isinstance(o.average_every, list) else [o.average_every]
    return [1] * o.warmup_steps + [h * (per_epoch if o.average_unit == "epochs" else 1) for h in every]


def round_boundaries(gaps: list[int], steps: int) -> list[int]:
    """The steps at which rounds come (gaps added up, the last repeating) below `steps`, then `steps`."""
    bounds, t, i = [], 0, 0
    while t + gaps[min(i, len(gaps) - 1)] < steps:
        t += gaps[min(i, len(gaps) - 1)]
        bounds.append(t)
        i += 1
    return bounds + [steps]
