"""Streaming DiLoCo (Douillard et al. 2025) for lo-fi's peer rounds: fragments synced at staggered
steps (`lofi.fragments`), each exchange overlapped with training (`lofi.overlap`).

Fragments: the tensors that cross (the floating-point state, in state-dict order) cut into F
contiguous groups of about equal packed bytes (`split`, by the codec's formula), never inside a
module: every node cuts its own model the same way. With H = average_every, fragment f syncs at
the steps t ≡ (f+1)·H/F (mod H), 0 < t < T (T: the last step), where the final round syncs all of
them at once (`schedule`); F = 1 is one sync every H steps. Each sync sends that
fragment's Δ only, with its own error feedback and outer momentum (both per tensor), so a sync
carries about 1/F of the bytes.

Overlap τ: the fragment sent at step t lands at step t + τ (or at the next sync, if that comes
first): meanwhile the node trains on, a background thread fetching and averaging its peers'
payloads (`InFlightRound`). When it lands the node takes the outer step on the global fragment, then
mixes it into its own weights, θ_local ← α·θ_local + (1−α)·θ_global (α: `lofi.mix`), keeping part
of the τ steps made in flight; with τ = 0 the node takes the global fragment as it is. With
`lofi.keep_training` it keeps all of them instead (`keep_on_top`): θ_local ← θ_global + (θ_local −
θ_sent).
"""

from __future__ import annotations

import threading

import torch

ALL = -1
"""The fragment index of a round that syncs every fragment (the final round)."""


def module_of(name: str) -> str:
    """The module a tensor belongs to: its name up to the last dot."""
    return name.rsplit(".", 1)[0]


def split(sizes: dict[str, int], count: int, unit=module_of) -> list[list[str]]:
    """Names cut into `count` contiguous groups of about equal total size, in the given order, never
    inside a `unit` (a module by default: a layer's weight, bias and BatchNorm statistics sync together;
    lo-fi's `merging.RoundMerging.sync_unit`, which keeps a LoRA layer's two factors together): a new group
    starts at a module once the running total reaches the next multiple of total/count (or when only
    as many modules are left as groups still to come). Needs at least `count` modules."""
    modules: list[list[str]] = []
    for name in sizes:
        if modules and unit(modules[-1][0]) == unit(name):
            modules[-1].append(name)
        else:
            modules.append([name])
    if not 1 <= count <= len(modules):
        raise ValueError(f"cannot cut {len(modules)} modules into {count} fragments")
    total, groups, running = sum(sizes.values()), [[]], 0
    for i, names in enumerate(modules):
        left = len(modules) - i  # modules not yet placed, this one included
        due = (
            len(groups) < count
            and groups[-1]
            and (running >= total * len(groups) / count or left == count - len(groups))
        )
        if due:
            groups.append([])
        groups[-1].extend(names)
        running += sum(sizes[name] for name in names)
    return groups


def schedule(every: int, fragments: int, steps: int) -> tuple[list[int], list[int]]:
    """The sync steps (then `steps`, the final round) and the fragment each one syncs (ALL for the
    final round): fragment f at (f+1)·every/fragments + j·every below `steps`."""
    offsets = [(f + 1) * every // fragments for f in range(fragments)]
    events = sorted((t, f) for f, offset in enumerate(offsets) for t in range(offset, steps, every))
    return [t for t, _ in events] + [steps], [f for _, f in events] + [ALL]


def landings(boundaries: list[int], overlap: int) -> list[int]:
    """The step at which the exchange sent at each boundary (but the last) lands: τ steps later, or at
    the next boundary if that comes first (no two exchanges are in flight at once)."""
    return [min(t + overlap, nxt) for t, nxt in zip(boundaries, boundaries[1:])]


def keep_on_top(mine: dict, sent: dict, landed: dict, params: set[str]) -> dict:
    """`lofi.keep_training` with overlap: the landed tensors' new values on a node. A parameter is its new
    global value with what the node trained since it sent its payload on top, θ ← G' + (θ − θ_sent) in
    float64, so the τ steps trained while the round was in flight are not dropped (they cross in the
    node's next payload, which measures Δ from G'); another floating tensor (BatchNorm statistics, where
    they cross) is the global one. A node that trained nothing since it sent (θ = θ_sent) gets G' bit for bit."""
    out = {}
    for k, g in landed.items():
        if k in params:
            on_top = mine[k].to(torch.float64) - sent[k].to(torch.float64)
            out[k] = (g.to(torch.float64) + on_top).to(mine[k].dtype)
        else:
            out[k] = g
    return out


class InFlightRound:
    """A round's exchange in flight on a node: `fetch()` (fetching and averaging the peers' payloads)
    runs in a thread while the node trains; `result()` waits for it and returns its value or raises
    its error."""

    def __init__(self, round_: int, fragment: int, fetch):
        self.round, self.fragment = round_, fragment
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fetch,), name=f"lofi-round-{round_}", daemon=True)
        self._thread.start()

    def _run(self, fetch) -> None:
        try:
            self._value = fetch()
        except BaseException as err:  # re-raised in the training thread by result()
            self._error = err

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
