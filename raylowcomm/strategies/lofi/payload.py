"""What crosses in a peer round: a node's outer gradient Δ = θ_global − θ_k over the tensors that
cross (`crossing`), encoded with `lofi.compress` and its error feedback (`DeltaCodec`). Every node
and the driver build the same codec from their own model, so they decode the same payloads into
the same bits."""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from raylowcomm.core.aggregation import average_decoded
from raylowcomm.core.compression import NoCompression, Payload, layout_of
from raylowcomm.core.feedback import ErrorFeedback
from raylowcomm.core.secure_codes import add_tensors, mask_tensor, masked_nbytes, sums_of
from raylowcomm.core.summable import SummableInt, average_codes, make, mean_of_sums
from raylowcomm.strategies.lofi.probe import head_names
from raylowcomm.strategies.lofi.robust_average import RobustAverage, is_robust, marker

BN_STATISTICS = (".running_mean", ".running_var")
FINAL_CODECS = {"compressed": None, "int8": "int8", "exact": "none"}
"""lofi.final_round → the codec of the final round's parameters (None: `compress`'s)."""


def final_is_own(opts) -> bool:
    """Whether the final round is encoded unlike the others (`lofi.final_round`, `lofi.final_residual`):
    the nodes are then told which round is the final one."""
    return opts.final_round != "compressed" or not opts.final_residual


def floats(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point()}


def crossing(state: dict, opts) -> dict:
    """The tensors that cross in a round: the floating-point ones, but with `lofi.bn_recalibrate` not
    the BatchNorm running statistics, which the end recomputes for the average anyway (training uses
    batch statistics; each node keeps its own meanwhile). Without recalibration they cross, uncompressed."""
    return {k: v for k, v in floats(state).items() if not (opts.bn_recalibrate and k.endswith(BN_STATISTICS))}


def dense_names(model: nn.Module, family: str, patterns: list[str]) -> set[str]:
    """The parameters `lofi.dense` names: `head` the new head (`head_names`), `vectors` every 1-D
    parameter (biases, norm weights), anything else a shell pattern on parameter names. Raises
    ValueError naming a pattern that matches no parameter."""
    params = dict(model.named_parameters())
    names: set[str] = set()
    for pattern in patterns:
        if pattern == "head":
            found = set(head_names(model, family))
        elif pattern == "vectors":
            found = {n for n, p in params.items() if p.dim() == 1}
        else:
            found = {n for n in params if fnmatchcase(n, pattern)}
        if not found:
            raise ValueError(f"{pattern!r} matches no parameter of the model")
        names |= found
    return names


class DeltaCodec:
    """How Δ crosses: the parameters with `lofi.compress`, each part with its own error feedback; the
    floating-point buffers that cross (BatchNorm statistics without recalibration) uncompressed, since
    a quantised running variance can go below zero. The parameters `dense` names (`lofi.dense`: the new
    head, say, which top-k would otherwise move a few percent a round) cross whole in `lofi.dense_codec`.
    One flat payload (name → bytes) holds every part; every node and the driver build the same parts
    from their own model. The final round may encode the parameters with a codec of its own
    (`lofi.final_round`), flushing the residuals through it. With `lofi.aggregate` other than mean or
    `lofi.on_bad_payload: drop` rounds combine by `RobustAverage` (`host`: the node, None on the driver).
    With `lofi.compress_scale: shared` the int8/int4/int2 parts are `SummableInt`: a round decodes their
    codes on its shared scales, and a node's residual of them is settled when its round is averaged."""

    def __init__(self, opts, state: dict, params: set[str], dense: set[str] = frozenset(), host=None):
        fl = crossing(state, opts)
        block, scale = opts.compress_block, opts.compress_scale
        codec = make(opts.compress, block, opts.topk_fraction, scale)
        weights = layout_of({k: v for k, v in fl.items() if k in params and k not in dense})
        whole = layout_of({k: v for k, v in fl.items() if k in params and k in dense})
        buffers = (NoCompression(), layout_of({k: v for k, v in fl.items() if k not in params}))
        self.parts = [(codec, weights), (make(opts.dense_codec, block, scale=scale), whole), buffers]
        self.feedback = [ErrorFeedback(c) for c, _ in self.parts] if opts.error_feedback else None
        flush = FINAL_CODECS[opts.final_round]
        self.final_parts = self.parts
        if flush is not None and flush != opts.compress:
            final = make(flush, block, scale=scale)
            self.final_parts = [(final, weights), (final, whole), buffers]
        self.final_residual = opts.final_residual
        self.robust = RobustAverage(opts, host) if is_robust(opts) else None

    @property
    def nbytes(self) -> int:
        return sum(codec.payload_nbytes(layout) for codec, layout in self.parts)

    def sizes(self) -> dict[str, int]:
        """Each tensor's packed bytes in a payload: what fragments are balanced by."""
        return {k: codec.packed_nbytes(spec) for codec, layout in self.parts for k, spec in layout.items()}

    def _parts(self, final: bool) -> list:
        return self.final_parts if final else self.parts

    def _feedback(self, i: int, codec) -> ErrorFeedback:
        """Part i's error feedback; for the final round's own codec, one over the same residuals."""
        if self.feedback[i].codec is codec:
            return self.feedback[i]
        flush = ErrorFeedback(codec)
        flush.residual = self.feedback[i].residual  # the same dict: what the flush drops stays the residual
        flush.pending = self.feedback[i].pending
        return flush

    def encode(self, delta: dict, final: bool = False) -> Payload:
        """Δ (float64, over all tensors or one fragment's) → payload; the none codec sends Δ in the
        weights' own dtype, rounded here. `final`: the final round's codec, and its residual unless
        `lofi.final_residual` is false. A Δ that is not finite, with `on_bad_payload: drop`: `marker()`."""
        if self.robust is not None and not self.robust.sendable(delta):
            return marker()
        payload, feedback = Payload(), self.feedback and (self.final_residual or not final)
        for i, (codec, layout) in enumerate(self._parts(final)):
            part = {
                k: delta[k].to(spec.dtype) if codec.name == "none" else delta[k]
                for k, spec in layout.items()
                if k in delta
            }
            if part:
                payload.update(self._feedback(i, codec).encode(part) if feedback else codec.encode(part))
        return payload

    def average(
        self, payloads: list[Payload], weights: list[float], final: bool = False, round_=None, own: int | None = None
    ) -> dict:
        """Δ̄ in float64, each part decoded and averaged in the payloads' (node) order; by the rule of
        `lofi.aggregate` where rounds are robust (`round_`: the round, for its warnings and record). `own`:
        this node's index in `payloads`, whose summable parts' residuals the round settles (None: the driver)."""
        if self.robust is not None:
            return self.robust.average(self._parts(final), payloads, weights, round_)
        mean = {}
        for i, (codec, layout) in enumerate(self._parts(final)):
            names = [k for k in layout if k in payloads[0]]  # one fragment's, or all
            if names and isinstance(codec, SummableInt):
                feedback = self._feedback(i, codec) if self.feedback and own is not None else None
                for k in names:
                    flat, scales = average_codes(codec, [p[k] for p in payloads], layout[k], weights)
                    mean[k] = flat.view(layout[k].shape)
                    if feedback is not None:
                        feedback.settle(k, payloads[own][k], scales)
            elif names:
                parts = [Payload({k: p[k] for k in names}) for p in payloads]
                mean.update(average_decoded(codec, parts, layout, weights, dtype=torch.float64))
        return mean

    def mask(self, payload: Payload, final: bool, masker, slot: str, members: list[int], nodes: int) -> Payload:
        """`lofi.secure`: this node's payload masked for `slot` among `members` by its `core.secagg.SecAggNode`
        (`masker`), tensor by tensor (`core.secure_codes`): what crosses instead of the payload."""
        return Payload(
            {
                k: mask_tensor(masker, codec, payload[k], layout[k], f"{slot}|{k}", members, nodes)
                for codec, layout in self._parts(final)
                for k in layout
                if k in payload
            }
        )

    def masked_nbytes(self, payload: Payload, final: bool, nodes: int) -> tuple[int, int]:
        """(bytes of masked codes, bytes of masked magnitudes) of `payload` masked (`mask`)."""
        sizes = [
            masked_nbytes(codec, layout[k], nodes)
            for codec, layout in self._parts(final)
            for k in layout
            if k in payload
        ]
        return sum(c for c, _ in sizes), sum(m for _, m in sizes)

    def add_masked(self, masked: list[Payload], final: bool, nodes: int) -> Payload:
        """Every member's masked payload added, tensor by tensor (`core.secure_codes.add_tensors`): the
        round's sums, laid out as one masked payload is; what the driver sends back in secure star rounds."""
        return Payload(
            {
                k: add_tensors(codec, [p[k] for p in masked], layout[k], nodes)
                for codec, layout in self._parts(final)
                for k in layout
                if k in masked[0]
            }
        )

    def average_of_sum(self, total: Payload, members: int, final: bool, nodes: int, own: Payload | None = None) -> dict:
        """Δ̄ of a secure round from its members' added payloads (`add_masked`, of `members` payloads): each
        tensor's sums decoded as a round in the clear decodes them (`mean_of_sums`), the same bits; `own`:
        this node's payload, whose residuals the round settles (None: the driver)."""
        mean = {}
        for i, (codec, layout) in enumerate(self._parts(final)):
            feedback = self._feedback(i, codec) if self.feedback and own is not None else None
            for k in (k for k in layout if k in total):
                code_sum, magnitude_sum = sums_of(codec, total[k], layout[k], nodes, members)
                flat, scales = mean_of_sums(code_sum, magnitude_sum, members, codec.block_size)
                mean[k] = flat.view(layout[k].shape)
                if feedback is not None:
                    feedback.settle(k, own[k], scales)
        return mean

    def average_masked(self, masked: list[Payload], final: bool, nodes: int, own: Payload | None = None) -> dict:
        """Δ̄ of a secure round from every member's masked payload (`add_masked`, then `average_of_sum`)."""
        return self.average_of_sum(self.add_masked(masked, final, nodes), len(masked), final, nodes, own)

    def decode_each(self, payloads: list[Payload], final: bool = False) -> list[dict]:
        """Each node's Δ in float64, in node order: for a fine-tune that merges rounds (`merges_rounds`,
        LoRA), whose average is not the mean of Δ; small, as what crosses there is adapters."""
        return [
            {
                k: v
                for codec, layout in self._parts(final)
                for k, v in codec.decode(
                    Payload({k: p[k] for k in layout if k in p}), layout, dtype=torch.float64
                ).items()
            }
            for p in payloads
        ]

    def forget(self, names) -> None:
        """Drop the error-feedback residuals of tensors that restarted (`ErrorFeedback.forget`)."""
        for fb in self.feedback or []:
            fb.forget(names)

    def residual(self) -> dict:
        return {k: v for fb in self.feedback or [] for k, v in fb.state_dict().items()}

    def load_residual(self, state: dict) -> None:
        for fb, (_, layout) in zip(self.feedback or [], self.parts):
            fb.load_state_dict({k: v for k, v in state.items() if k in layout})
