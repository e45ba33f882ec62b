"""The FLOP handles are keyed on the node kinds torch.jit's tracer records."""
import torch
import torch.nn.functional as F

from lapformer_mm.analysis.flops import (
    attention_flops,
    flop_analyzer,
    flop_totals,
    traced_name,
)
from lapformer_mm.ops import attention, laplacian_kernel, nystrom_attention


def traced_kinds(fn, *inputs):
    """Node kinds of a trace of ``fn``, PythonOps with their class name as mmengine does."""
    graph = torch.jit.trace(fn, inputs, check_trace=False).graph
    return {n.kind() + ('.' + n.pyname() if n.kind() == 'prim::PythonOp' else '')
            for n in graph.nodes()}


def test_traced_names_match_the_tracer():
    x, y = torch.randn(1, 5, 4, requires_grad=True), torch.randn(1, 3, 4)
    assert traced_name(torch.ops.aten.cdist) in traced_kinds(
        lambda a, b: laplacian_kernel(a, b, 4.0), x, y)
    q = torch.randn(1, 2, 5, 4)
    lm = torch.randn(1, 2, 3, 4)
    for impl in ('reference', None):
        assert traced_name(attention.nystrom_attention_op) in traced_kinds(
            lambda a, b: nystrom_attention(a, a, a, b, impl=impl), q.requires_grad_(), lm)
    assert traced_name(torch.ops.aten.scaled_dot_product_attention) in traced_kinds(
        lambda a: F.scaled_dot_product_attention(a, a, a), q.detach())


def test_softmax_attention_counts_as_visible():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6)
    totals = flop_totals(flop_analyzer(Attention(), (q, k, v)))
    # batch · heads · N · M · (d + d_v)
    assert totals == dict(full=2 * 3 * 5 * 7 * (4 + 6), visible=2 * 3 * 5 * 7 * (4 + 6),
                          kernel=0, solve=0)


def test_flop_formula_counts_the_composite_parts():
    parts = attention_flops((2, 3, 100, 32), (2, 3, 100, 32), 49, True, 16, True)
    batch = 6
    assert parts == dict(kernel=batch * (100 * 49 + 49 * 49) * 33,
                         solve=batch * (2 * 49 ** 3 * 16 + 49 * 49),
                         visible=batch * (2 * 100 * 49 * 32 + 3 * 49 * 49 * 32))
    separate = attention_flops((2, 3, 100, 32), (2, 3, 100, 32), 49, False, 16, False)
    assert separate['kernel'] - parts['kernel'] == batch * 100 * 49 * 33
    assert parts['visible'] - separate['visible'] == batch * 2 * 49 * 49 * 32
