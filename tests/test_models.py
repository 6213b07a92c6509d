"""model.memory_format: where a model computes in channels_last, and that the layout never changes
what is sent, hashed or saved (the same bits as the contiguous model's)."""

import pytest
import torch

from raylowcomm.common.hashing import parameter_hash
from raylowcomm.models import ModelSpec, build_architecture, channels_last, place, state_dict_of
from raylowcomm.storage import Storage


@pytest.mark.parametrize(
    "family, memory_format, device, expected",
    [
        ("timm", "auto", "cpu", True),
        ("timm", "auto", "cuda", False),
        ("hf_classifier", "auto", "cpu", False),
        ("hf_causal_lm", "auto", "cpu", False),
        ("timm", "channels_last", "cuda", True),
        ("timm", "contiguous", "cpu", False),
    ],
)
def test_auto_is_channels_last_for_timm_models_on_cpu_only(family, memory_format, device, expected):
    assert channels_last(ModelSpec(family, memory_format=memory_format), device) is expected


def cnn(memory_format: str = "auto") -> tuple[torch.nn.Module, ModelSpec]:
    spec = ModelSpec("timm", num_classes=10, timm_arch="tf_efficientnet_lite0", memory_format=memory_format)
    torch.manual_seed(0)
    return build_architecture(spec), spec


def test_a_placed_cnn_computes_in_channels_last_and_its_weights_are_the_same_bits():
    model, spec = cnn()
    before, hash_before = state_dict_of(model), parameter_hash(list(model.named_parameters()))
    placed = place(model, spec, "cpu")
    stem = placed.conv_stem.weight
    assert stem.is_contiguous(memory_format=torch.channels_last) and not stem.is_contiguous()
    after = state_dict_of(placed)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) and after[k].is_contiguous() for k in before)
    assert parameter_hash(list(placed.named_parameters())) == hash_before


@pytest.mark.parametrize("memory_format, keep_contiguous", [("contiguous", False), ("auto", True)])
def test_contiguous_asked_or_kept_leaves_torchs_layout(memory_format, keep_contiguous):
    model, spec = cnn(memory_format)
    placed = place(model, spec, "cpu", keep_contiguous=keep_contiguous)
    assert all(p.is_contiguous() for p in placed.parameters())


def test_a_channels_last_model_and_its_momentum_save_and_load_back_exactly(tmp_path):
    model, spec = cnn()
    placed = place(model, spec, "cpu")
    opt = torch.optim.SGD(placed.parameters(), lr=0.1, momentum=0.9)
    placed(torch.rand(2, 3, 32, 32)).sum().backward()
    opt.step()
    momentum = opt.state[placed.conv_stem.weight]["momentum_buffer"]
    assert not momentum.is_contiguous()  # safetensors refuses such a tensor as it is
    tensors = {**dict(placed.named_parameters()), "stem_momentum": momentum}
    tensors = {k: v.detach() for k, v in tensors.items()}
    Storage(str(tmp_path)).save_tensors("state.safetensors", tensors)
    loaded, _ = Storage(str(tmp_path)).load_tensors("state.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
