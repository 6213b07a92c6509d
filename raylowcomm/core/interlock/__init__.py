"""Interlocking backpropagation (Gomez et al. 2020) in plain torch: `routing` (which head's loss
trains which stage, the messages between stages, one stage's work), `splitting` (stages of a
timm CNN or a decoder LM, balanced), `heads` (aux heads and losses). No Ray here."""
