"""Error feedback (`lofi.error_feedback`): what a codec dropped is added to the next Δ before it is
encoded, so nothing is lost, only delayed. Why the float64 residual keeps Σ sent + kept = Σ Δ exact:
`core.compression`'s module docstring."""

from __future__ import annotations

import torch
from torch import Tensor

from raylowcomm.core.compression import Codec, Payload, flat_float64, layout_of


class ErrorFeedback:
    """A node's memory of what compression dropped: adds it to the next Δ before encoding and keeps the
    new residual, so nothing is lost, only delayed. Residuals are float64 (see the module docstring for
    why that makes Σ sent + kept = Σ Δ exact). Tensors not in a round's Δ (other fragments) keep theirs."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residual: dict[str, Tensor] = {}

    def encode(self, delta: dict[str, Tensor]) -> Payload:
        payload = Payload()
        for name, spec in layout_of(delta).items():
            x = flat_float64(delta[name], name)
            if name in self.residual:
                kept = self.residual[name]
                if kept.shape != spec.shape:
                    raise ValueError(f"residual of {name!r} is {tuple(kept.shape)}, Δ is {tuple(spec.shape)}")
                x = x + kept.to(x.device).reshape(-1)
            payload[name], decoded = self.codec.pack_decoded(x, spec)
            self.residual[name] = decoded.neg_().add_(x).view(spec.shape)  # x − d, in d's memory
        return payload

    def forget(self, names) -> None:
        """Drop the residuals of `names`: tensors restarted from scratch (LoRA factors after a merge), whose
        old residual would be noise in the new factors."""
        for name in names:
            self.residual.pop(name, None)

    def state_dict(self) -> dict[str, Tensor]:
        """Plain name → float64 tensor, ready for safetensors."""
        return {name: r.clone() for name, r in self.residual.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        bad = [name for name, r in state.items() if r.dtype != torch.float64]
        if bad:
            raise ValueError(f"residuals must be float64 to stay exact; not so: {bad[:5]}")
        self.residual = {name: r.clone() for name, r in state.items()}
