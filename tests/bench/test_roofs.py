"""The machine roofs and the FLOP count behind the benchmarks' "% of bound" columns, against hand counts."""

from __future__ import annotations

import torch

from covrl.bench.common import count_flops, measure_bandwidth, measure_matmul_flops


def test_count_flops_of_a_linear_forward_backward_by_hand():
    n, d_in, d_out = 5, 7, 3
    layer = torch.nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(n, d_in)
    # forward x @ W^T: 2 n d_in d_out; backward dW only (x needs no gradient): the same again
    assert count_flops(lambda: layer(x).sum().backward()) == 4 * n * d_in * d_out
    x.requires_grad_(True)
    # dX as well: a third product of the same size
    assert count_flops(lambda: layer(x).sum().backward()) == 6 * n * d_in * d_out


def test_count_flops_of_a_two_layer_mlp_by_hand():
    n, d, h = 4, 6, 10
    mlp = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, d))
    x = torch.randn(n, d)
    # first layer: forward + dW (its input needs no gradient); second layer: forward + dW + dX
    assert count_flops(lambda: mlp(x).sum().backward()) == 4 * n * d * h + 6 * n * h * d


def test_roofs_are_positive_and_finite():
    assert 0 < measure_matmul_flops(64, repeats=2) < float("inf")
    assert 0 < measure_matmul_flops(64, repeats=2, dtype="bfloat16") < float("inf")
    assert 0 < measure_bandwidth(8, repeats=2) < float("inf")


def test_decode_matmul_floor_runs_every_linear_layer(monkeypatch):
    from covrl.bench import rollout_bench

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    shapes = []
    real = torch.nn.functional.linear

    def spy(x, w, *a):
        shapes.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, *a)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    assert rollout_bench.decode_matmul_floor_s(model, batch=3, repeats=1) > 0
    # two passes (warm-up + one timed), each over both layers at batch 3
    assert shapes == [((3, 8), (16, 8)), ((3, 16), (4, 16))] * 2
