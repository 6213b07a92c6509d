"""Zeroth-order fine-tuning with shared randomness: SPSA (MeZO) whose updates are replayed
from (seed, one byte) on every node (Just One Byte).

A node never sends weights or gradients: it sends one projected gradient g per perturbation,
quantised to a byte. The perturbation z is regenerated from a seed that every node derives
from (run seed, step, node, sample), so every node applies the same update θ ← θ − lr·g·z and
the replicas stay bit-identical. Plain torch: nothing here knows about Ray.

`perturb`: seeded perturbations, the measurements (two-point; one-sided sharing L(θ)) and the
step; `estimators`: projected gradients from the measured losses, forward-pass counts and the
step rules (plain; normalised by the spread of the step's decoded g); `codec`: what crosses the
network per sample; `replay`: seeds, the replay log and one node's `Replica`.

Bit-identity rests on three rules kept throughout this package:
  * z comes from a CPU `torch.Generator` seeded once per seed, parameters in a fixed order,
    drawn in fixed-size chunks (`CHUNK`), so the stream does not depend on the device;
  * θ is parked while θ ± εz is measured and comes back by a storage swap, never arithmetically;
  * every node, including the one that measured g, applies the DECODED g, in (node, sample)
    order, with the same sequence of tensor ops.
"""
