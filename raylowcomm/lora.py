"""LoRA adapters (peft) for every strategy: wrapping a model, what a node sends, how the nodes'
adapters are averaged, restarting adapters after an averaging round, saving; `LoraFineTune` is
what a LoRA run asks all of it through (`finetune.fine_tune_for`). The only module that knows
peft. Plain torch: no Ray.

Two forms of a state dict appear here. The PEFT model's names its frozen weights
`base_model.model.<path>.base_layer.weight`, its adapters `<path>.lora_A.default.weight` and
`<path>.lora_B.default.weight`, and a trainable head `<path>.modules_to_save.default.weight`
(next to a frozen `original_module` copy). The plain model (the architecture without adapters,
what merging gives) names the same weights `<path>.weight`; `plain_key` maps one to the other.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import peft
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import ConfigError, LoraConfig
from raylowcomm.core.aggregation import MEAN, check_weights
from raylowcomm.models import ModelSpec, build_architecture, state_dict_of
from raylowcomm.training import save_weights

logger = logging.getLogger(__name__)

ADAPTER = "default"
"""The one adapter every model here carries (peft's default name)."""
_PREFIX = "base_model.model."
_ADAPTER_ONLY = re.compile(r"\.(lora_\w+|original_module)\.")
_TASK_TYPE = {"hf_classifier": peft.TaskType.SEQ_CLS, "hf_causal_lm": peft.TaskType.CAUSAL_LM}

State = dict[str, torch.Tensor]


# --- building ----------------------------------------------------------------------------------


def _timm_targets(model: nn.Module, head: str) -> list[str]:
    """peft knows no default for timm: every Linear and ungrouped Conv2d outside the head (grouped,
    i.e. depthwise, convolutions cannot be merged by peft)."""
    return [
        name
        for name, module in model.named_modules()
        if not (name == head or name.startswith(head + "."))
        and (isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1))
    ]


def peft_config(cfg: LoraConfig, family: str, model: nn.Module) -> peft.LoraConfig:
    """The peft config; the new head goes in `modules_to_save` (peft's task types do that for HF
    classifiers) so it trains and is saved with the adapter."""
    kwargs = {"r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": cfg.target_modules}
    if family in _TASK_TYPE:
        kwargs["task_type"] = _TASK_TYPE[family]
    else:
        head = model.pretrained_cfg["classifier"]
        kwargs["modules_to_save"] = [head]
        if cfg.target_modules is None:
            kwargs["target_modules"] = _timm_targets(model, head)
    return peft.LoraConfig(**kwargs)


def apply_lora(model: nn.Module, spec: ModelSpec, seed: int | None = None) -> nn.Module:
    """`model` wrapped in the adapters `spec.lora` asks for: base frozen, adapters and head trainable.
    With `seed` the adapters start from `init_adapters(seed)`; without, from the global RNG (a model
    that then loads a state dict, as actors do)."""
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, peft_config(spec.lora, spec.family, model))
    except ValueError as err:  # peft: no default for this architecture, or a name that matches nothing
        raise ConfigError("model.lora.target_modules", spec.lora.target_modules, str(err)) from None
    _head_in_fp32(wrapped)
    if seed is not None:
        init_adapters(wrapped, seed)
    return wrapped


def _head_in_fp32(model: nn.Module) -> None:
    """On a bf16/fp16 base (model.dtype) what trains stays fp32: peft keeps the adapters fp32 and
    casts their input itself (its autocast_adapter_dtype); the new head is made fp32 here and its
    input cast to fp32 on the way in, so the logits and the loss are fp32 too."""
    for module in model.modules():
        if isinstance(module, peft.utils.ModulesToSaveWrapper):
            head = module.modules_to_save[ADAPTER]
            if any(p.dtype != torch.float32 for p in head.parameters()):
                head.float()
                head.register_forward_pre_hook(_to_fp32)


def _to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _lora_modules(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def init_adapters(model: nn.Module, seed: int, only: set[str] | None = None) -> None:
    """Adapters as at a fresh start, from `seed` alone: A Kaiming-uniform (peft's init) drawn from a
    private CPU generator in module order, so it depends on neither the global RNG nor the device;
    B zero, so the adapted model computes exactly what its base does. `only`: the layers (module
    names) to restart; every layer's A is still drawn, so a layer's draw does not depend on which."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, layer in _lora_modules(model):
            a = layer.lora_A[ADAPTER].weight
            fresh = torch.empty(a.shape, dtype=a.dtype)
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            if only is None or name in only:
                a.copy_(fresh)
                layer.lora_B[ADAPTER].weight.zero_()


# --- what a node has and sends -----------------------------------------------------------------


def trainable_state(model: nn.Module) -> State:
    """The tensors that train (adapters and head): what a node sends. CPU copies, contiguous, so
    later steps do not change what was sent."""
    return {
        name: p.detach().cpu().clone(memory_format=torch.contiguous_format)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass(frozen=True)
class AdaptedLayer:
    """One adapted layer: PEFT-form keys of its factors and frozen weight, the plain-form key of
    that weight, and the scale (alpha / r) of its update scale·B·A."""

    a: str
    b: str
    base: str
    plain: str
    scale: float
    shape: tuple[int, ...]

    def delta(self, state: State) -> torch.Tensor:
        """scale·B·A from a node's tensors, in float64, shaped like the weight. For a convolution,
        A is (r, in, kh, kw) and B (out, r, 1, 1): the same product over the flattened factors."""
        b, a = state[self.b].double().flatten(1), state[self.a].double().flatten(1)
        return (self.scale * (b @ a)).view(self.shape)


def _check_mergeable(name: str, layer: LoraLayer) -> None:
    base = layer.get_base_layer()
    if ADAPTER in layer.lora_embedding_A or getattr(layer, "fan_in_fan_out", False) or getattr(base, "groups", 1) > 1:
        raise NotImplementedError(
            f"{name}: only Linear and ungrouped Conv LoRA layers can be averaged exactly; "
            "leave embeddings, GPT-2 Conv1D and depthwise convolutions out of "
            "model.lora.target_modules"
        )


def lora_layers(model: nn.Module) -> list[AdaptedLayer]:
    """Every adapted layer of a PEFT model, in module order."""
    layers = []
    for name, layer in _lora_modules(model):
        _check_mergeable(name, layer)
        base = f"{name}.base_layer.weight"
        layers.append(
            AdaptedLayer(
                a=f"{name}.lora_A.{ADAPTER}.weight",
                b=f"{name}.lora_B.{ADAPTER}.weight",
                base=base,
                plain=plain_key(base),
                scale=float(layer.scaling[ADAPTER]),
                shape=tuple(layer.get_base_layer().weight.shape),
            )
        )
    return layers


def plain_key(key: str) -> str | None:
    """The plain model's name for a PEFT state-dict key; None for adapter factors and the frozen
    copy of the original head. A plain key maps to itself."""
    if _ADAPTER_ONLY.search(key):
        return None
    return key.removeprefix(_PREFIX).replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


# --- averaging ---------------------------------------------------------------------------------


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """One weight > 0 per node state (uniform by default), for `core.aggregation`'s mean."""
    return check_weights([1.0] * n if weights is None else weights, n)


def _mean(states: Sequence[State], w: list[float], key: str) -> torch.Tensor:
    """Weighted mean of one tensor over the nodes (`core.aggregation.MEAN`, float64), rounded once."""
    return MEAN.combine((s[key].double() for s in states), w).to(states[0][key].dtype)


def _merged_weight(base: torch.Tensor, layer: AdaptedLayer, states: Sequence[State], w: list[float]) -> torch.Tensor:
    """base + the nodes' mean of scale·B_k·A_k (`core.aggregation.MEAN`, float64), rounded once to base's
    dtype, on base's device."""
    delta = MEAN.combine((layer.delta(s) for s in states), w)
    return (base.double() + delta.to(base.device)).to(base.dtype)


def _check_same_keys(states: Sequence[State]) -> None:
    for k, s in enumerate(states[1:], 1):
        if s.keys() != states[0].keys():
            odd = sorted(s.keys() ^ states[0].keys())[:5]
            raise ValueError(f"node state {k} differs from node state 0 in keys: {odd}")


def average_factors(node_states: Sequence[State], weights: Sequence[float] | None = None) -> State:
    """FedAvg of the factors: mean A, mean B, mean head. NOT the average of what the nodes learned
    (mean(B)·mean(A) ≠ mean(B·A)); kept to measure that gap. Its merged model is
    `average_delta(base, [average_factors(states)], layers)`."""
    w = _weights(weights, len(node_states))
    _check_same_keys(node_states)
    return {key: _mean(node_states, w, key) for key in node_states[0]}


def average_delta(
    base_state: State,
    node_states: Sequence[State],
    layers: Sequence[AdaptedLayer],
    weights: Sequence[float] | None = None,
) -> State:
    """The exact lo-fi average of the nodes' models, as a plain (merged, adapter-free) state dict:
    W = W0 + Σ_k w_k·scale·B_k·A_k per adapted layer (w_k normalised; uniform by default), the head
    and any other trainable tensor averaged plainly, everything else W0. Exact because every node's
    model is W0 + scale·B_k·A_k on the same frozen W0, so this equals averaging the full weights.

    `base_state`: the nodes' common frozen weights, in PEFT form (the model's state dict) or plain
    form (the previous round's average); only their non-adapter tensors are read. With one node
    state this is that node's merged model."""
    w = _weights(weights, len(node_states))
    _check_same_keys(node_states)
    merged = {pk: v for k, v in base_state.items() if (pk := plain_key(k)) is not None}
    factors = {key for layer in layers for key in (layer.a, layer.b)}
    for key in node_states[0].keys() - factors:
        merged[plain_key(key)] = _mean(node_states, w, key)
    for layer in layers:
        merged[layer.plain] = _merged_weight(merged[layer.plain], layer, node_states, w)
    return merged


@dataclass
class AdapterAverage:
    """lo-fi's average of adapters on top of the nodes' common frozen `base`: `delta`, the exact
    average of what they learned, or `factors`, FedAvg of A and B (for comparison). Returns the
    plain merged state; after an averaging round it becomes the next round's base (lo-fi's
    `NodeAverage` under LoRA)."""

    base: State
    layers: list[AdaptedLayer]
    how: str = "delta"
    what: ClassVar[str] = "node_adapters"

    def __call__(self, node_states: Sequence[State], weights: Sequence[float] | None = None) -> State:
        if self.how == "factors":
            return average_delta(self.base, [average_factors(node_states, weights)], self.layers)
        return average_delta(self.base, node_states, self.layers, weights)

    def gather(self, states: Iterable[tuple[int, State]], weights: Sequence[float]) -> NodeAdapters:
        """Every node's adapters and head, kept (they are small) in node order with their weights."""
        got = dict(states)
        return NodeAdapters([got[k] for k in sorted(got)], [weights[k] for k in sorted(got)], self.how)

    def combine(self, gathered: NodeAdapters) -> State:
        return self(gathered.states, gathered.weights)

    def rebase(self, state: State) -> None:
        self.base = state

    def sent(self, payload: NodeAdapters | State) -> tuple[str, int]:
        """The nodes' adapters cross to be merged where they are scored; a merged model crosses whole."""
        if isinstance(payload, NodeAdapters):
            return "adapters_to_score", sum(payload_nbytes(s) for s in payload.states)
        return "weights_to_score", payload_nbytes(payload)


@dataclass
class NodeAdapters:
    """Every node's adapters and head with their weights: what crosses for the lo-fi average to be
    merged where it is scored, on the frozen base that node already holds (the same on every node),
    instead of a merged model of the full size."""

    states: list[State]
    weights: list[float]
    how: str = "delta"

    def merged_on(self, model: nn.Module) -> State:
        base = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return AdapterAverage(base, lora_layers(model), self.how)(self.states, self.weights)


def merge_and_reset(model: nn.Module, merged_state: State, seed: int) -> None:
    """Start the next round from the exact average: the frozen base (and head) load `merged_state`
    (`average_delta`'s output) and the adapters restart from `init_adapters(seed)`, B = 0, so the
    PEFT model computes exactly the merged model. Every node must pass the same seed, so the replicas
    stay identical; a new seed each round (e.g. derived from run seed and round) starts every round
    in a fresh random subspace, as ReLoRA does, instead of re-learning in the same one. The
    optimizer's state for the adapters no longer fits them: the caller resets it."""
    wanted = {k: pk for k in model.state_dict() if (pk := plain_key(k)) is not None}
    if set(wanted.values()) != merged_state.keys():
        odd = sorted(set(wanted.values()) ^ merged_state.keys())[:5]
        raise ValueError(f"merged state does not match the model's plain weights, e.g. {odd}")
    model.load_state_dict({k: merged_state[pk] for k, pk in wanted.items()}, strict=False)
    init_adapters(model, seed)


@contextlib.contextmanager
def computing(model: nn.Module, plain: State) -> Iterator[nn.Module]:
    """The PEFT model made to compute the plain model `plain` (e.g. the nodes' average merged on this
    node's base) while the block runs, then put back as it was: every tensor of `plain` that is not the
    model's own (the merged layers, the head) swapped in, and the adapters' scaling 0. A node scores
    the average on the base it holds without a second copy of the model (an 8B base is 16 GB)."""
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}  # tied weights: one tensor, several names
    for key, tensor in model.state_dict(keep_vars=True).items():
        if (pk := plain_key(key)) is not None:
            tensors.setdefault(id(tensor), (tensor, []))[1].append(pk)
    pairs = [
        (tensor, next((plain[pk] for pk in names if pk in plain), None), names) for tensor, names in tensors.values()
    ]
    missing = [names for _, new, names in pairs if new is None]
    if missing:  # before anything is swapped
        raise KeyError(f"the plain state to compute has none of {missing[0]}")
    swapped = []
    for tensor, new, _ in pairs:
        if new.data_ptr() != tensor.data_ptr():
            swapped.append((tensor, tensor.data))
            tensor.data = new.to(tensor.device, tensor.dtype)
    scales = [(m, m.scaling) for _, m in _lora_modules(model)]
    for m, scaling in scales:
        m.scaling = {name: 0.0 for name in scaling}
    try:
        yield model
    finally:
        for tensor, data in swapped:
            tensor.data = data
        for m, scaling in scales:
            m.scaling = scaling


def merge_nodes(
    model: nn.Module, node_states: Sequence[State], weights: Sequence[float], how: str = "delta", seed: int = 0
) -> list[str]:
    """A peer round landing on a node: the nodes' adapters and head (`node_states`, all or one fragment's
    tensors) averaged as `average_delta` does, in place: each adapted layer's frozen weight += Σ_k
    w_k·scale·B_k·A_k (float64, rounded once to its dtype), the head and other trainables their mean;
    then those layers' adapters restart from `seed`. `how` factors: the factors' mean merged instead.
    Every node that merges the same states in the same order gets the same bits. Returns the factor
    names restarted (their optimizer state and error-feedback residual no longer fit)."""
    if how == "factors":
        node_states, weights = [average_factors(node_states, weights)], None
    w = _weights(weights, len(node_states))
    layers = [layer for layer in lora_layers(model) if layer.a in node_states[0]]
    factors = {key for layer in layers for key in (layer.a, layer.b)}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in sorted(node_states[0].keys() - factors):
            params[key].copy_(_mean(node_states, w, key))
        for layer in layers:
            params[layer.base].copy_(_merged_weight(params[layer.base], layer, node_states, w))
    init_adapters(model, seed, only={layer.a.rsplit(".lora_A.", 1)[0] for layer in layers})
    return sorted(factors)


# --- saving ------------------------------------------------------------------------------------


def save_lora(model_or_state: nn.Module | State, spec: ModelSpec, out_dir: str | Path, merge: bool) -> Path:
    """Save a LoRA result. merge=False: the adapter and head as peft writes them
    (adapter_model.safetensors + adapter_config.json: small, `PeftModel.from_pretrained` puts them
    on the base). merge=True: the full merged model (`merge_and_unload`): a Hugging Face folder, or
    model.safetensors for timm. Takes a PEFT model, its state dict, or a plain merged state
    (`average_delta`'s output: merge only, since an average of adapters is no longer one rank-r
    adapter)."""
    state = state_dict_of(model_or_state) if isinstance(model_or_state, nn.Module) else model_or_state
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(k.startswith(_PREFIX) for k in state):
        model = apply_lora(build_architecture(spec), spec)
        model.load_state_dict(state)
        if not merge:
            model.save_pretrained(str(out))
            logger.info("saved the adapter to %s", out)
            return out
        plain = model.merge_and_unload()
    elif merge:
        plain = build_architecture(spec)
        plain.load_state_dict(state)
    else:
        raise ValueError(
            "an averaged (merged) state cannot be saved as an adapter: save it with merge=True (model.merge: true)"
        )
    if hasattr(plain, "save_pretrained"):
        plain.save_pretrained(str(out))
    else:
        save_weights(out / "model.safetensors", state_dict_of(plain))
    logger.info("saved the merged model to %s", out)
    return out


def save_adapter(weights: State, model: nn.Module, out_dir: Path) -> Path:
    """The adapter as peft writes it, from the adapters and head alone, on a copy of `model` whose
    base is on the meta device (the driver of a run whose nodes loaded the weights): peft writes
    the tensors that train, never the base."""
    wrapped = copy.deepcopy(model)
    wrapped.load_state_dict(weights, strict=False, assign=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir))
    logger.info("saved the adapter to %s", out_dir)
    return out_dir


# --- the fine-tune ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraFineTune:
    """`finetune.FineTune` for adapters: only the adapters and the new head train, so only they are
    sent, all-reduced and checkpointed (until an average moves the base); lo-fi averages them
    exactly on the nodes' common base, and each averaging round restarts them on the merged one."""

    spec: ModelSpec

    def wrap(self, model: nn.Module, seed: int | None = None) -> nn.Module:
        return apply_lora(model, self.spec, seed)

    def node_state(self, model: nn.Module) -> State:
        return trainable_state(model)

    def trainable_only(self, base_moved: bool = False) -> bool:
        return not base_moved

    def plain_state(self, payload: NodeAdapters | State | None, model: nn.Module) -> State:
        """The nodes' adapters merged on this node's base, a merged model as it came, or (None) this
        node's own model merged."""
        if payload is None:
            return average_delta(state_dict_of(model), [trainable_state(model)], lora_layers(model))
        return payload.merged_on(model) if isinstance(payload, NodeAdapters) else payload

    def plain_names(self, state: State) -> State:
        return {plain_key(k): v for k, v in state.items()}

    def computing(self, model: nn.Module, plain: State) -> contextlib.AbstractContextManager[nn.Module | None]:
        """This node's PEFT model, computing `plain` in place for a while (`computing`)."""
        return computing(model, plain)

    def save_result(self, weights: State, model: nn.Module, out_dir: Path, merge: bool) -> dict[str, str]:
        """The adapter as peft writes it where the result is adapters on the pretrained base (SPSA,
        DDP), and with model.merge the merged model (always the form of lo-fi's average, which is no
        longer one rank-r adapter)."""
        adapters = any(".lora_" in k for k in weights)
        if adapters and any(p.is_meta for p in model.parameters()):  # the base is on the nodes (model.source)
            return {"adapter_dir": str(save_adapter(weights, model, out_dir / "adapter"))}
        full = {**state_dict_of(model), **weights} if adapters else weights
        out = {}
        if adapters:
            out["adapter_dir"] = str(save_lora(full, self.spec, out_dir / "adapter", merge=False))
        if merge:
            out["merged_dir"] = str(save_lora(full, self.spec, out_dir / "merged", merge=True))
        return out
