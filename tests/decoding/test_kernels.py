"""Small-batch linear kernels compute the same products (up to float rounding), leave training
alone, and are kept only when measured faster."""

import torch
from torch import nn

from onlinespec.decoding import kernels
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.decoding.proposers.ngram import NgramProposer


def test_products_match_nn_linear_for_every_row_count(one_thread):
    torch.manual_seed(0)
    big = nn.Linear(64, kernels.LARGE // 64 + 1, bias=False)  # large: one row runs as two
    small = nn.Linear(24, 40, bias=True)
    for layer in (big, small):
        for shape in [(1, 1, layer.in_features), (1, 5, layer.in_features), (3, layer.in_features), (2, 9, layer.in_features), (40, layer.in_features)]:
            x = torch.randn(shape)
            expected = layer(x)
            kernels.enable(layer)
            got = layer(x)
            kernels.disable(layer)
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_training_passes_and_disable_restore_nn_linear():
    layer = nn.Linear(8, 4)
    kernels.enable(layer)
    assert kernels.enabled(layer)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()  # gradients flow through the stock path
    assert x.grad is not None and layer.weight.grad is not None
    kernels.disable(layer)
    assert not kernels.enabled(layer)


def test_greedy_decoding_is_unchanged(tiny_llama, one_thread):
    target = tiny_llama(0, vocab_size=32, hidden_size=32)
    prompt, params = [1, 2, 3, 1, 2], SamplingParams(max_new_tokens=16, ignore_eos=True)
    stock = SpeculativeDecoder(target, None, NgramProposer(), k=3).generate(prompt, params).token_ids
    kept, stock_costs, fast_costs = kernels.use_small_batch_kernels(target, max_width=4)
    assert len(stock_costs) == len(fast_costs) == 4 and kernels.enabled(target) == kept
    kernels.enable(target)
    assert SpeculativeDecoder(target, None, NgramProposer(), k=3).generate(prompt, params).token_ids == stock
    kernels.disable(target)
