"""Error feedback (`lofi.error_feedback`): what a codec dropped is added to the next Δ before it is
encoded, so nothing is lost, only delayed. Why the float64 residual keeps Σ sent + kept = Σ Δ exact:
`core.compression`'s module docstring. With summable codes (`core.summable`) the residual is x − q·S on
the round's shared scales S, known only when the round's payloads are in: it is settled then (`settle`)."""

from __future__ import annotations

import torch
from torch import Tensor

from raylowcomm.core.compression import Codec, Payload, TensorSpec, flat_float64, layout_of
from raylowcomm.core.summable import SummableInt, residual


class ErrorFeedback:
    """A node's memory of what compression dropped: adds it to the next Δ before encoding and keeps the
    new residual, so nothing is lost, only delayed. Residuals are float64 (see the module docstring for
    why that makes Σ sent + kept = Σ Δ exact). Tensors not in a round's Δ (other fragments) keep theirs."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residual: dict[str, Tensor] = {}
        self.pending: dict[str, Tensor] = {}
        """A `SummableInt` codec's sent x = Δ + r per tensor, until its round settles the residual."""

    def encode(self, delta: dict[str, Tensor]) -> Payload:
        payload = Payload()
        for name, spec in layout_of(delta).items():
            x = flat_float64(delta[name], name)
            if name in self.residual:
                kept = self.residual[name]
                if kept.shape != spec.shape:
                    raise ValueError(f"residual of {name!r} is {tuple(kept.shape)}, Δ is {tuple(spec.shape)}")
                x = x + kept.to(x.device).reshape(-1)
            if isinstance(self.codec, SummableInt):  # its residual needs the round's shared scales: `settle`
                payload[name] = self.codec.pack(x, spec)
                self.residual.pop(name, None)
                self.pending[name] = x.view(spec.shape)
                continue
            payload[name], decoded = self.codec.pack_decoded(x, spec)
            self.residual[name] = decoded.neg_().add_(x).view(spec.shape)  # x − d, in d's memory
        return payload

    def settle(self, name: str, packed: Tensor, scales: Tensor) -> None:
        """A `SummableInt` codec's round is in: `name`'s residual becomes x − q·S, x what this node sent,
        q its codes (`packed`, its payload's tensor) and S the round's shared scales. A tensor sent
        without error feedback has nothing pending and keeps its residual."""
        x = self.pending.pop(name, None)
        if x is not None:
            codes, _ = self.codec.codes(packed, TensorSpec(x.shape, x.dtype))
            self.residual[name] = residual(x.reshape(-1), codes, scales, self.codec.block_size).view(x.shape)

    def forget(self, names) -> None:
        """Drop the residuals of `names`: tensors restarted from scratch (LoRA factors after a merge), whose
        old residual would be noise in the new factors."""
        for name in names:
            self.residual.pop(name, None)
            self.pending.pop(name, None)

    def state_dict(self) -> dict[str, Tensor]:
        """Plain name → float64 tensor, ready for safetensors: the settled residuals."""
        return {name: r.clone() for name, r in self.residual.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        bad = [name for name, r in state.items() if r.dtype != torch.float64]
        if bad:
            raise ValueError(f"residuals must be float64 to stay exact; not so: {bad[:5]}")
        self.residual = {name: r.clone() for name, r in state.items()}
        self.pending = {}
