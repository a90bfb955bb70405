"""The Triton re-rotation kernel against the PyTorch reference and against keys rotated directly to
their new positions (on CPU through the Triton interpreter, tiny shapes).

bf16 round-off: the interpreter converts fp32 to bf16 by truncation, CUDA by round-to-nearest-even,
and the reference by round-to-nearest-even, so bf16 results are compared within one bf16 ulp; fp32
and fp16 results are compared exactly (fp16) or to 1e-6 (fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference.rope import rotate

MAX_POSITION = 4096


def random_pool(layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]


FP32_SLACK = 1e-5


def assert_within_bf16_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` differs from ``expected`` by at most one bf16 ulp of ``expected`` plus the FP32
    round-off both sides carry (on CUDA the kernel fuses multiply-adds the reference rounds twice)."""
    exp = expected.float()
    ulp = torch.ldexp(torch.ones_like(exp), torch.frexp(exp).exponent - 8)
    assert bool(((actual.float() - exp).abs() <= ulp + FP32_SLACK).all()), (actual.float() - exp).abs().max()


def assert_matches(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(actual, expected):
        if want.dtype == torch.bfloat16:
            assert_within_bf16_ulp(got, want)
        elif want.dtype == torch.float16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=FP32_SLACK, rtol=0)


def run_both(spec, k_pool, v_pool, src, dst, old, new, launch=None, stacked=False):
    """Run kernel and reference on copies of the same pools; return (kernel K, kernel V, ref K, ref V)."""
    device = k_pool[0].device
    k_kernel = [t.clone() for t in k_pool]
    v_kernel = [t.clone() for t in v_pool]
    k_ref = [t.clone() for t in k_pool]
    v_ref = [t.clone() for t in v_pool]
    index = {name: torch.tensor(x, dtype=torch.int64, device=device)
             for name, x in (("src", src), ("dst", dst), ("old", old), ("new", new))}
    rope = RopeTable.build(spec, MAX_POSITION, device)
    if stacked:
        k_stack, v_stack = torch.stack(k_kernel), torch.stack(v_kernel)
        rerotate_kv(LayerBuffers.of(k_stack), LayerBuffers.of(v_stack), index["src"], index["dst"],
                    index["old"], index["new"], rope, launch=launch)
        k_kernel, v_kernel = list(k_stack.unbind(0)), list(v_stack.unbind(0))
    else:
        rerotate_kv(LayerBuffers.of(k_kernel), LayerBuffers.of(v_kernel), index["src"], index["dst"],
                    index["old"], index["new"], rope, launch=launch)
    rerotate_kv_reference(LayerBuffers.of(k_ref), LayerBuffers.of(v_ref), index["src"], index["dst"],
                          index["old"], index["new"], spec)
    return k_kernel, v_kernel, k_ref, v_ref


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(neox, rotary_dim, dtype, device):
    spec = RopeSpec(theta=10000.0, head_dim=16, rotary_dim=rotary_dim, neox=neox)
    k_pool = [t.to(device) for t in random_pool(3, 32, 3, 16, dtype, seed=1)]
    v_pool = [t.to(device) for t in random_pool(3, 32, 3, 16, dtype, seed=2)]
    src, dst = [1, 2, 3, 4, 5, 6], [20, 21, 3, 22, 5, 23]
    old, new = [100, 2000, 70, 80, 9, 4000], [5, 6, 7, 80, 9, 1]
    k_got, v_got, k_want, v_want = run_both(spec, k_pool, v_pool, src, dst, old, new)
    assert_matches(k_got, k_want)
    assert_matches(v_got, v_want)


def test_stacked_layout_and_partial_programs(device):
    """A stacked [layers, slots, heads, dim] pool, with launches whose copy blocks and layer groups do
    not divide the problem evenly."""
    spec = RopeSpec(theta=1e6, head_dim=8, rotary_dim=8)
    k_pool = [t.to(device) for t in random_pool(5, 24, 2, 8, torch.float32, seed=3)]
    v_pool = [t.to(device) for t in random_pool(5, 24, 2, 8, torch.float32, seed=4)]
    src, dst = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
    old, new = [30, 31, 32, 33, 34], [0, 1, 2, 3, 4]
    for launch in (RerotateLaunch(block_copies=2, layers_per_program=2), RerotateLaunch(4, 3), RerotateLaunch(8, 5)):
        k_got, v_got, k_want, v_want = run_both(spec, k_pool, v_pool, src, dst, old, new, launch, stacked=True)
        assert_matches(k_got, k_want)
        assert_matches(v_got, v_want)


def test_rerotated_keys_equal_keys_rotated_at_new_position(device):
    """K stored at ``old`` (fp32), re-rotated by the kernel, equals the raw key rotated straight to
    ``new`` by the reference formula, to 1e-5, also for large positions and backward moves."""
    spec = RopeSpec(theta=1e6, head_dim=32, rotary_dim=32)
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(6, 4, 32, generator=gen)
    old = torch.tensor([131071, 50000, 17, 0, 99999, 262143])
    new = torch.tensor([0, 49999, 40000, 262000, 3, 262143])
    stored = rotate(raw, old, theta=spec.theta)
    k = torch.zeros(16, 4, 32)
    k[:6] = stored
    k = k.to(device)
    v = torch.zeros_like(k)
    rope = RopeTable.build(spec, 262144, device)
    dst = torch.arange(6, 12, device=device)
    rerotate_kv(LayerBuffers.of([k]), LayerBuffers.of([v]), torch.arange(6, device=device), dst,
                old.to(device), new.to(device), rope)
    torch.testing.assert_close(k[6:12].cpu(), rotate(raw, new, theta=spec.theta), atol=1e-5, rtol=0)


def test_same_position_copies_bits_and_in_place_leaves_slot_alone(device):
    spec = RopeSpec(theta=10000.0, head_dim=16, rotary_dim=16)
    k_pool = [t.to(device) for t in random_pool(2, 16, 2, 16, torch.bfloat16, seed=6)]
    v_pool = [t.to(device) for t in random_pool(2, 16, 2, 16, torch.bfloat16, seed=7)]
    before_k = [t.clone() for t in k_pool]
    before_v = [t.clone() for t in v_pool]
    dev = lambda x: torch.tensor(x, device=device)
    rerotate_kv(LayerBuffers.of(k_pool), LayerBuffers.of(v_pool), dev([1, 2, 3]), dev([9, 2, 10]),
                dev([40, 41, 42]), dev([40, 41, 7]), RopeTable.build(spec, 64, device))
    for layer in range(2):
        assert torch.equal(k_pool[layer][9], before_k[layer][1])
        assert torch.equal(v_pool[layer][9], before_v[layer][1])
        assert torch.equal(v_pool[layer][10], before_v[layer][3])
        assert not torch.equal(k_pool[layer][10], before_k[layer][3])
        untouched = [s for s in range(16) if s not in (9, 10)]
        assert torch.equal(k_pool[layer][untouched], before_k[layer][untouched])
        assert torch.equal(v_pool[layer][untouched], before_v[layer][untouched])


def test_in_place_rotation_keeps_v_and_tail(device):
    spec = RopeSpec(theta=10000.0, head_dim=16, rotary_dim=8)
    k_pool = [t.to(device) for t in random_pool(2, 8, 2, 16, torch.float32, seed=8)]
    v_pool = [t.to(device) for t in random_pool(2, 8, 2, 16, torch.float32, seed=9)]
    before_k = [t.clone() for t in k_pool]
    before_v = [t.clone() for t in v_pool]
    dev = lambda x: torch.tensor(x, device=device)
    rerotate_kv(LayerBuffers.of(k_pool), LayerBuffers.of(v_pool), dev([3]), dev([3]), dev([30]), dev([2]),
                RopeTable.build(spec, 64, device))
    for layer in range(2):
        expected = rotate(rotate(before_k[layer][3:4].cpu(), torch.tensor([-30]), theta=1e4, rotary_dim=8),
                          torch.tensor([2]), theta=1e4, rotary_dim=8)
        torch.testing.assert_close(k_pool[layer][3:4].cpu(), expected, atol=1e-6, rtol=0)
        assert torch.equal(k_pool[layer][3, :, 8:], before_k[layer][3, :, 8:])
        assert torch.equal(v_pool[layer], before_v[layer])


def test_value_heads_may_differ_from_key_heads(device):
    spec = RopeSpec(theta=10000.0, head_dim=16, rotary_dim=16)
    k_pool = [t.to(device) for t in random_pool(2, 8, 2, 16, torch.float32, seed=10)]
    v_pool = [t.to(device) for t in random_pool(2, 8, 3, 24, torch.float32, seed=11)]
    k_got, v_got, k_want, v_want = run_both(spec, k_pool, v_pool, [1, 2], [5, 6], [9, 10], [0, 1])
    assert_matches(k_got, k_want)
    assert_matches(v_got, v_want)


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    neox=st.booleans(),
    half=st.integers(1, 5),
    extra=st.integers(0, 3),
    heads=st.integers(1, 3),
    layers=st.integers(1, 3),
)
def test_random_copy_lists_match_reference(data, neox, half, extra, heads, layers):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    slots = 24
    head_dim = 2 * half + extra
    n = data.draw(st.integers(0, 8))
    perm = data.draw(st.permutations(range(slots)))
    dst, free = perm[:n], perm[n:]
    src = [d if data.draw(st.booleans()) else data.draw(st.sampled_from(free)) for d in dst]
    positions = st.integers(0, MAX_POSITION - 1)
    old = data.draw(st.lists(positions, min_size=n, max_size=n))
    new = data.draw(st.lists(positions, min_size=n, max_size=n))
    spec = RopeSpec(theta=10000.0, head_dim=head_dim, rotary_dim=2 * half, neox=neox)
    k_pool = [t.to(device) for t in random_pool(layers, slots, heads, head_dim, torch.float32, seed=n)]
    v_pool = [t.to(device) for t in random_pool(layers, slots, heads, head_dim, torch.float32, seed=n + 1)]
    k_got, v_got, k_want, v_want = run_both(spec, k_pool, v_pool, src, dst, old, new)
    assert_matches(k_got, k_want)
    assert_matches(v_got, v_want)
