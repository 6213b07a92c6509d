"""What trains in a run, answered in one place: every weight (`FullWeights`), or LoRA adapters and
a new head on a frozen base (`raylowcomm.lora.LoraFineTune`). `fine_tune_for(spec)` makes the one
object a run uses. The strategies and the actor layer ask it which tensors a node sends and a
checkpoint holds, how a global model or an average is loaded into a node's model, and how the
result is saved, so none of them looks at peft objects or parameter names. It converts the
architecture `models` builds (as torchtitan's model converters do): `models` knows nothing of
adapters, and `raylowcomm.lora` (peft) is imported for LoRA runs only."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from raylowcomm.config import ModelConfig
from raylowcomm.models import ModelSpec, build_architecture, load_base, state_dict_of, weights_readable

State = dict[str, torch.Tensor]


class FineTune(Protocol):
    """Which tensors train, and everything that follows from it."""

    def wrap(self, model: nn.Module, seed: int | None = None) -> nn.Module:
        """The architecture as it trains. With `seed`, what the conversion adds is drawn from it alone;
        without, from the global RNG (a model that then loads a state dict, as actors do)."""

    def node_state(self, model: nn.Module) -> State:
        """What a node sends of what it has learned: CPU copies that later steps do not change."""

    def trainable_only(self, base_moved: bool = False) -> bool:
        """Whether a checkpoint may hold only the tensors that train, every reader having the rest from
        the initial weights; not once an averaging round has moved that rest (`base_moved`)."""

    def plain_state(self, payload: object, model: nn.Module) -> State:
        """Plain weights to score from what the driver sent (an average of the nodes: plain weights, or
        under LoRA the nodes' adapters), put together on this node's `model` where the payload needs its
        base; None: `model`'s own, which after the final peer round is the average."""

    def plain_names(self, state: State) -> State:
        """Tensors of the model as it trains, under the plain architecture's names."""

    def computing(self, model: nn.Module, plain: State) -> contextlib.AbstractContextManager[nn.Module | None]:
        """A context in which `model` computes the plain weights `plain` and after which it is as it was
        (a node scoring an average on the base it holds); None from it where `model` cannot without a
        copy of every weight: the caller scores in a model of its own."""

    def save_result(self, weights: State, model: nn.Module, out_dir: Path, merge: bool) -> dict[str, str]:
        """Save a strategy's result `weights` (the pretrained model: `model`) in the fine-tune's own
        forms too, under `out_dir` (model.merge: merged); the record's details saying where."""


class FullWeights:
    """Every weight trains, is sent, checkpointed and loaded: the plain model is the model that trains."""

    def wrap(self, model: nn.Module, seed: int | None = None) -> nn.Module:
        return model

    def node_state(self, model: nn.Module) -> State:
        return state_dict_of(model)

    def trainable_only(self, base_moved: bool = False) -> bool:
        return False

    def plain_state(self, payload: State | None, model: nn.Module) -> State:
        return state_dict_of(model) if payload is None else payload

    def plain_names(self, state: State) -> State:
        return state

    def computing(self, model: nn.Module, plain: State) -> contextlib.AbstractContextManager[nn.Module | None]:
        """Every weight would change: a model of the caller's own is no larger than a copy to put back."""
        return contextlib.nullcontext(None)

    def save_result(self, weights: State, model: nn.Module, out_dir: Path, merge: bool) -> dict[str, str]:
        """model.safetensors (saved by every strategy) is the whole result."""
        return {}


def fine_tune_for(spec: ModelSpec) -> FineTune:
    """The run's fine-tune, from its model spec: adapters where `spec.lora` asks for them."""
    if spec.lora is None:
        return FullWeights()
    from raylowcomm.lora import LoraFineTune  # peft only for LoRA runs

    return LoraFineTune(spec)


def load_pretrained(
    cfg: ModelConfig, num_classes: int | None, seed: int, meta: bool = False
) -> tuple[nn.Module, ModelSpec, object]:
    """(model, spec, tokenizer): the pretrained model as it trains. A new head is drawn from `seed`,
    so it is the same on every node; with `cfg.lora` so are the adapters (base frozen). `meta`: its
    architecture on the meta device only (`models.load_base`): what the driver plans with."""
    model, spec, tokenizer = load_base(cfg, num_classes, seed, meta=meta)
    return fine_tune_for(spec).wrap(model, seed), spec, tokenizer


@dataclass(frozen=True)
class ModelRecipe:
    """How a node loads the pretrained model itself, the data recipe's counterpart: the model
    section, the number of classes and the seed. `load` is `load_pretrained` itself, so every node
    (and a driver that loads) holds the same bits, new head and adapters included."""

    cfg: ModelConfig
    num_classes: int | None
    seed: int

    def load(self) -> nn.Module:
        return load_pretrained(self.cfg, self.num_classes, self.seed)[0]

    def readable(self) -> bool:
        """Whether this host can load the weights (`models.weights_readable`)."""
        return weights_readable(self.cfg)


def on_meta(model: nn.Module) -> bool:
    """Whether `model` holds no weights (the driver's plan of a model its nodes load)."""
    return any(p.is_meta for p in model.parameters())


def build_model(spec: ModelSpec) -> nn.Module:
    """The model as it trains, with random weights: what an actor loads the shipped state dict into."""
    return fine_tune_for(spec).wrap(build_architecture(spec))
