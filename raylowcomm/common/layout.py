"""Tensors laid out in memory as their parameter is, for fused optimizer steps."""

import torch


def laid_out_like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a gradient, a momentum: `param`'s shape) in `param`'s memory layout, in its own
    dtype. A fused SGD/AdamW step walks a parameter, its gradient and its state in raw memory order,
    without checking strides: a contiguous buffer beside a channels_last weight would pair the wrong
    entries. `.backward()` lays gradients out as their parameters are; `autograd.grad` and a
    checkpoint's contiguous tensors do not."""
    if tensor.stride() == param.stride():
        return tensor
    return torch.empty_like(param, dtype=tensor.dtype).copy_(tensor)
