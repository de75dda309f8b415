"""bitdelta_linear (packed signs, many variants in one batch) against the merged weights x (W + D_v)^T.

D_v is what the codec decodes; the packed signs and scales are what it stores (codec.read_bitdelta).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zoo_gym import codec
from zoo_gym.serving.kernels import bitdelta_linear, bitdelta_linear_reference, log8_scale_codes


def _variants(out_f: int, in_f: int, n: int, *, group_size: int | None, seed: int = 0):
    """n random deltas of a (out_f, in_f) weight: (dense decoded D_v, packed signs, float32 scales, group length)."""
    g = torch.Generator().manual_seed(seed)
    dense, signs, scales, gs = [], [], [], None
    for i in range(n):
        payload = codec.encode({"w": torch.randn(out_f, in_f, generator=g) * 0.05}, codec="bitdelta",
                               group_size=group_size)
        p = codec.read_bitdelta(payload, "w")
        dense.append(codec.decode(payload)["w"].float())
        signs.append(p.signs)
        scales.append(p.scales)
        gs = p.group_size
    return dense, signs, scales, gs


def _merged(x, weight, bias, dense, variant_of_row):
    """Each row through its own merged weight, in float64: the answer serving must reproduce."""
    rows = []
    for b, v in enumerate(variant_of_row.tolist()):
        w = weight.double() + (dense[v].double() if v >= 0 else 0)
        y = x[b].double() @ w.T
        rows.append(y + bias.double() if bias is not None else y)
    return torch.stack(rows)


LAYOUTS = [
    (96, 256, 128),    # groups of 128
    (70, 200, 128),    # in not a multiple of 128: a short last group; out not a multiple of the 8-row step
    (33, 1001, 128),   # in not a multiple of 8: padded sign bytes
    (64, 200, None),   # one scale per row, whole-row group of 25 bytes (odd: 8-lane words)
    (40, 1001, None),  # whole row, in not a multiple of 8
    (48, 256, 8),      # 1-byte groups (odd byte count: 8-lane words)
    (20, 96, -1),      # one scale for the whole tensor
]


@pytest.mark.parametrize("out_f,in_f,group_size", LAYOUTS)
def test_mixed_batch_equals_merged_weights(out_f, in_f, group_size):
    dense, signs, scales, gs = _variants(out_f, in_f, 3, group_size=group_size)
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    x = torch.randn(6, 3, in_f, generator=g)
    variant_of_row = torch.tensor([2, -1, 0, 2, 1, -1])  # several variants, repeated, and base rows

    y = bitdelta_linear(x, weight, bias, signs, scales, gs, variant_of_row)

    want = _merged(x, weight, bias, dense, variant_of_row)
    base = _merged(x, weight, bias, dense, torch.full((6,), -1))
    assert (want - base)[variant_of_row >= 0].abs().max() > 0.1  # the deltas matter
    torch.testing.assert_close(y.double(), want, rtol=0, atol=2e-4 * want.abs().max().item())
    torch.testing.assert_close(y[variant_of_row < 0], torch.nn.functional.linear(x, weight, bias)[variant_of_row < 0])


def test_bfloat16_inputs_match_merged_within_bf16_rounding():
    dense, signs, scales, gs = _variants(128, 384, 4, group_size=128)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(128, 384, generator=g).bfloat16()
    x = torch.randn(5, 2, 384, generator=g).bfloat16()
    variant_of_row = torch.tensor([3, 0, -1, 1, 2])

    y = bitdelta_linear(x, weight, None, signs, scales, gs, variant_of_row)

    assert y.dtype == torch.bfloat16
    want = _merged(x.float(), weight.float(), None, dense, variant_of_row)
    err = (y.double() - want).abs().max().item()
    assert err <= 0.02 * want.abs().max().item()  # bf16 keeps 8 bits: ~0.4% per value
    ref = bitdelta_linear_reference(x, weight, None, signs, scales, gs, variant_of_row)
    assert (y.float() - ref.float()).abs().max().item() <= 0.01 * ref.float().abs().max().item()


@pytest.mark.parametrize("out_f,in_f,group_size", LAYOUTS)
def test_bf16_inputs_on_every_group_layout(out_f, in_f, group_size):
    """bf16 activations take the bf16 kernel where groups are whole 32-bit words (float32 elsewhere): on
    every layout the delta is x D_v^T of the merged weights, to the bf16 rounding of the output."""
    dense, signs, scales, gs = _variants(out_f, in_f, 3, group_size=group_size)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 2, in_f, generator=g).bfloat16()
    weight = torch.zeros(out_f, in_f, dtype=torch.bfloat16)  # y is the delta alone
    variant_of_row = torch.tensor([2, -1, 0, 2, 1, -1])

    y = bitdelta_linear(x, weight, None, signs, scales, gs, variant_of_row)

    want = _merged(x.float(), weight.float(), None, dense, variant_of_row)
    assert want[variant_of_row >= 0].abs().max() > 0.1  # the deltas matter
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-5 * want.abs().max().item())


def test_long_prompt_takes_the_tile_path_and_agrees():
    dense, signs, scales, gs = _variants(64, 128, 2, group_size=128)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 100, 128, generator=g)  # 100 tokens per row: more than the table path takes
    variant_of_row = torch.tensor([1, 0, 1])

    y = bitdelta_linear(x, weight, None, signs, scales, gs, variant_of_row)

    torch.testing.assert_close(y.double(), _merged(x, weight, None, dense, variant_of_row), rtol=0, atol=1e-3)


@pytest.mark.parametrize("tokens", [2, 300])  # the kernel path and the tile path
def test_log8_codes_in_memory_give_the_same_outputs_as_float32_scales(tokens):
    """Scales kept as the codec's 1-byte log8 codes (plus one reference per tensor) compute the same thing."""
    dense, signs, scales, gs = _variants(72, 300, 3, group_size=128)  # codec default for groups: log8
    coded = [log8_scale_codes(c) for c in scales]
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(72, 300, generator=g)
    x = torch.randn(4, tokens, 300, generator=g)
    variant_of_row = torch.tensor([1, -1, 0, 2])

    y = bitdelta_linear(x, weight, None, signs, [c for c, _ in coded], gs, variant_of_row,
                        scale_refs=[r for _, r in coded])

    assert all(c.dtype == torch.uint8 and c.shape == s.shape for (c, _), s in zip(coded, scales))
    torch.testing.assert_close(y, bitdelta_linear(x, weight, None, signs, scales, gs, variant_of_row),
                               rtol=0, atol=1e-5)
    want = _merged(x, weight, None, dense, variant_of_row)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=2e-4 * want.abs().max().item())
    off_grid = scales[0].clone()
    off_grid[0, 0] *= 1.01  # grid steps are 4.4% apart
    with pytest.raises(ValueError, match="not log8"):
        log8_scale_codes(off_grid)


def test_base_only_batch_is_the_plain_linear():
    _, signs, scales, gs = _variants(16, 64, 1, group_size=128)
    x, weight = torch.randn(2, 1, 64), torch.randn(16, 64)
    y = bitdelta_linear(x, weight, None, signs, scales, gs, torch.tensor([-1, -1]))
    assert torch.equal(y, torch.nn.functional.linear(x, weight))


def test_signs_that_do_not_fit_the_weight_are_refused():
    _, signs, scales, gs = _variants(16, 64, 1, group_size=128)
    with pytest.raises(ValueError, match="do not fit"):
        bitdelta_linear(torch.randn(1, 1, 72), torch.randn(16, 72), None, signs, scales, gs, torch.tensor([0]))


@pytest.mark.parametrize("change", ["signs_cols", "scale_rows", "groups", "codes_without_ref"])
def test_a_packed_weight_that_does_not_fit_its_shape_is_refused_when_built(change):
    """Layers call the kernels with prechecked=True: a variant's PackedWeight is where a misfit must stop."""
    from zoo_gym.serving.variant import PackedWeight

    _, signs, scales, gs = _variants(16, 256, 1, group_size=128)  # (16, 32) signs, (16, 2) scales
    s, c, ref = signs[0], scales[0], None
    if change == "signs_cols":
        s = s[:, :16]
    elif change == "scale_rows":
        c = c[:3]
    elif change == "groups":
        c = torch.cat([c, c], dim=1)
    else:
        c = c.to(torch.uint8)
    PackedWeight(shape=(16, 256), signs=signs[0], scales=scales[0], group_size=gs)  # the unchanged one fits
    with pytest.raises(ValueError, match="do not fit"):
        PackedWeight(shape=(16, 256), signs=s, scales=c, group_size=gs, scale_ref=ref)


_PEAK_SCRIPT = textwrap.dedent("""
    import torch
    from zoo_gym.serving.kernels import bitdelta_linear, warm_up

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    out_f = in_f = 4096
    n = 4
    signs = [torch.randint(0, 256, (out_f, in_f // 8), dtype=torch.uint8) for _ in range(n)]
    scales = [torch.rand(out_f, in_f // 128) for _ in range(n)]
    weight = torch.randn(out_f, in_f).bfloat16()
    x = torch.randn(n, 1, in_f).bfloat16()
    vr = torch.arange(n)
    warm_up()
    bitdelta_linear(x[:, :, :64], weight[:, :64], None, [s[:, :8].contiguous() for s in signs],
                    [c[:, :1].contiguous() for c in scales], 64, vr)
    reset(); before = hwm()
    bitdelta_linear(x, weight, None, signs, scales, 128, vr)
    kernel = hwm() - before
    reset(); before = hwm()
    dense = (signs[0].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)).reshape(out_f, -1).float()
    control = hwm() - before
    print(kernel, control)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_no_dense_copy_of_a_variant_is_made():
    """Peak RSS of one call with 4 variants of a 4096 x 4096 weight stays far below one dense float32
    copy (64 MiB); the same process making one such copy does raise its peak by that much."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.split()
    kernel, control = int(out[0]), int(out[1])
    dense_bytes = 4096 * 4096 * 4
    assert control >= 0.9 * dense_bytes  # the measurement sees a dense copy when there is one
    assert kernel < dense_bytes / 8, f"peak grew by {kernel} bytes during bitdelta_linear"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton kernel)")
def test_triton_kernel_equals_cpu_kernel():
    dense, signs, scales, gs = _variants(200, 1001, 3, group_size=128)
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(200, 1001, generator=g), torch.randn(200, generator=g)
    x = torch.randn(5, 3, 1001, generator=g)
    variant_of_row = torch.tensor([0, 2, -1, 1, 0])

    cpu = bitdelta_linear(x, weight, bias, signs, scales, gs, variant_of_row)
    gpu = bitdelta_linear(x.cuda(), weight.cuda(), bias.cuda(), [s.cuda() for s in signs],
                          [c.cuda() for c in scales], gs, variant_of_row.cuda())

    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-3)
    torch.testing.assert_close(cpu.double(), _merged(x, weight, bias, dense, variant_of_row), rtol=0, atol=1e-3)
