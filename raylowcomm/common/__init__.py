"""The leaf layer: batches and sampling, seeds, the byte ledger and timing. Plain Python, torch
and numpy only, so every other layer (core/ included) can use it without importing upward."""
