"""Target feature capture: which layer outputs, the argmax, the kernel path."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.demo import DemoConfig, tiny_qwen35_target
from dflash_dist.model.capture import capture_features, check_kernel_path, decoder_layers, gdn_kernel_path
from dflash_dist.model.config import build_target_layer_ids


@pytest.fixture(scope="module")
def qwen35():
    return tiny_qwen35_target(DemoConfig(target_layers=8))


def test_capture_picks_hidden_states_l_plus_1(qwen35):
    ids = torch.randint(0, 200, (2, 21))
    layer_ids = [1, 3, 5]
    cap = capture_features(qwen35, ids, layer_ids)
    with torch.no_grad():
        out = qwen35(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert cap.features.shape == (2, 21, 3 * qwen35.config.hidden_size)
    assert torch.equal(cap.features, want)
    off_by_one = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    assert not torch.allclose(cap.features, off_by_one)
    assert torch.equal(cap.target_argmax, out.logits.argmax(-1))
    assert cap.kernel_path == "torch" and gdn_kernel_path(qwen35) == "torch"


def test_last_layer_feature_is_before_final_norm(qwen35):
    ids = torch.randint(0, 200, (1, 9))
    n = qwen35.config.num_hidden_layers
    cap = capture_features(qwen35, ids, [n - 1])
    with torch.no_grad():
        out = qwen35(input_ids=ids, output_hidden_states=True)
    # HF's last entry is final-normed; ours is the raw output of the last decoder layer.
    assert not torch.allclose(cap.features, out.hidden_states[n])
    assert torch.allclose(qwen35.model.norm(cap.features), out.hidden_states[n], atol=1e-5)


def test_capture_any_hf_causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    layer_ids = build_target_layer_ids(6, 3)
    cap = capture_features(model, ids, layer_ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(cap.features, torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1))
    assert len(decoder_layers(model)) == 6
    assert cap.kernel_path == "torch"


def test_capture_rejects_bad_layer_ids(qwen35):
    with pytest.raises(ValueError, match="outside the target's 8 decoder layers"):
        capture_features(qwen35, torch.zeros(1, 4, dtype=torch.long), [1, 8])


def test_chunked_argmax_equals_full(qwen35):
    from dflash_dist.model.capture import chunked_argmax

    h = torch.randn(2, 37, qwen35.config.hidden_size)
    full = qwen35.lm_head(h).argmax(-1)
    assert torch.equal(chunked_argmax(h, qwen35.lm_head, chunk_tokens=5), full)


@pytest.mark.gpu
def test_cuda_capture_uses_fla_and_refuses_torch_path():
    assert torch.cuda.is_available()
    model = tiny_qwen35_target(DemoConfig(target_layers=8)).cuda()
    assert check_kernel_path(model) == "fla"
    cap = capture_features(model, torch.randint(0, 200, (1, 64), device="cuda"), [1, 3, 5])
    assert cap.kernel_path == "fla"


def test_kernel_path_policy_refuses_torch_gdn_on_cuda_unless_allowed():
    from dflash_dist.model.capture import kernel_path_refusal

    reason = kernel_path_refusal("torch", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=False)
    assert reason and "allow_torch_gdn_on_cuda" in reason and "flash-linear-attention" in reason
    assert kernel_path_refusal("torch", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=True) is None
    assert kernel_path_refusal("fla", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=False) is None
    assert kernel_path_refusal("torch", on_cuda=False, has_gdn=True, allow_torch_gdn_on_cuda=False) is None
    assert kernel_path_refusal("torch", on_cuda=True, has_gdn=False, allow_torch_gdn_on_cuda=False) is None
