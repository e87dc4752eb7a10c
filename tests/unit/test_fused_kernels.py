"""The fused RMSNorm(+residual) and rotary Triton kernels (radixserve.layers.fused), under
Triton's interpreter on the CPU (compiled on a GPU with RADIXSERVE_TEST_DEVICE=cuda:
tests/unit/devices.py), against the torch code of RMSNorm / RotaryEmbedding; the CUDA-only
dispatch in those layers; and that serving without triton never imports it.

bfloat16 note: the interpreter rounds float32 -> bfloat16 casts toward zero (the GPU rounds to
nearest even), so bf16 results can be one bf16 ulp off here; they get a 2e-2 tolerance.
float16 casts are exact in the interpreter (numpy), so float16 is checked tightly."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

# Before the kernels are defined (fused.kernels imported); tests/unit/conftest.py puts it back after collection and
# turns it on again around this module's tests only (triton reads it at each launch too). Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers import fused  # noqa: E402
from radixserve.layers.fused import kernels  # noqa: E402
from radixserve.layers.layernorm import RMSNorm  # noqa: E402
from radixserve.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

# The interpreter for this module's tests only (tests/unit/conftest.py; set above for the import; not on the GPU).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

F32_TOL = 1e-5
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the test positions span all three bands
}


def test_kernels_run_under_the_interpreter():
    """triton.jit picks the interpreter when the kernel is defined: a module that imported the
    kernels before TRITON_INTERPRET was set would leave GPU-only kernels here. On the GPU:
    compiled kernels, not interpreted ones."""
    assert_kernels_match_the_device(kernels._rmsnorm_kernel, kernels._rotary_kernel, kernels._rotate_heads)


# Values are drawn on the CPU, then moved: the same data on either device.
def _norm(width: int, seed: int) -> RMSNorm:
    norm = RMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(seed)).to(TEST_DEVICE)
    return norm


def _rope(*args) -> RotaryEmbedding:
    return RotaryEmbedding(*args).to(TEST_DEVICE)  # its cos/sin tables stay float32


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).to(TEST_DEVICE)


def _torch(layer, *args):
    """layer(*args) by the layer's own code, the reference: on a GPU its forward would otherwise
    take the very kernel under test (on the CPU it never does; the gate is off for cpu tensors)."""
    with mock.patch.object(fused, "ENABLED", False):
        return layer(*args)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    tol = {torch.float32: F32_TOL, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("width", [96, 128, 4096])
def test_rmsnorm_matches_torch(rows, width):
    norm = _norm(width, seed=width)
    x = _randn(rows, width, seed=rows)
    x_before = x.clone()
    out, new_residual = kernels.fused_add_rmsnorm(x, norm.weight, norm.variance_epsilon)
    assert new_residual is None
    _assert_close(out, _torch(norm, x), torch.float32)
    assert torch.equal(x, x_before)  # out of place


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("width", [96, 4096])
def test_rmsnorm_with_residual_matches_torch(rows, width):
    """Both outputs: the normalized sum and the sum itself (the next layer's residual)."""
    norm = _norm(width, seed=width + 1)
    x, residual = _randn(rows, width, seed=rows), _randn(rows, width, seed=rows + 100)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = kernels.fused_add_rmsnorm(x, norm.weight, norm.variance_epsilon, residual)
    ref_out, ref_residual = _torch(norm, x, residual)
    _assert_close(out, ref_out, torch.float32)
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # out of place


@pytest.mark.parametrize("heads,head_dim", [(8, 128), (3, 64), (1, 96)])
def test_rmsnorm_qk_norm_on_strided_heads(heads, head_dim):
    """Qwen3's q/k norm: RMSNorm over head_dim of [T, heads, head_dim], where q is a
    non-contiguous view into the fused qkv output (rows of head_dim with a token stride)."""
    T, kv_heads = 6, 2
    norm = _norm(head_dim, seed=heads)
    qkv = _randn(T, (heads + 2 * kv_heads) * head_dim, seed=head_dim)
    q = qkv[:, : heads * head_dim].reshape(T, heads, head_dim)
    assert not q.is_contiguous()
    out, _ = kernels.fused_add_rmsnorm(q, norm.weight, norm.variance_epsilon)
    _assert_close(out, _torch(norm, q), torch.float32)


def test_rmsnorm_on_head_major_layout():
    """[T, heads, D] viewed from a [heads, T, D] buffer: the head stride is T * D, not D."""
    T, heads, head_dim = 5, 3, 64
    norm = _norm(head_dim, seed=11)
    x = _randn(heads, T, head_dim, seed=12).transpose(0, 1)
    out, _ = kernels.fused_add_rmsnorm(x, norm.weight, norm.variance_epsilon)
    _assert_close(out, _torch(norm, x), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_half_precision(dtype):
    width = 96
    norm = _norm(width, seed=3)
    x, residual = _randn(9, width, seed=1, dtype=dtype), _randn(9, width, seed=2, dtype=dtype)
    out, new_residual = kernels.fused_add_rmsnorm(x, norm.weight, norm.variance_epsilon, residual)
    ref_out, ref_residual = _torch(norm, x, residual)
    _assert_close(out, ref_out, dtype)
    _assert_close(new_residual, ref_residual, dtype)
    if dtype == torch.float16:  # the sum is rounded to the input dtype, like the torch path
        assert torch.equal(new_residual, ref_residual)
    plain, _ = kernels.fused_add_rmsnorm(x, norm.weight, norm.variance_epsilon)
    _assert_close(plain, _torch(norm, x), dtype)


# ----------------------------------------------------------------------------- rotary


def _qk_views(T: int, heads: int, kv_heads: int, head_dim: int, seed: int, dtype=torch.float32):
    """q and k as the model makes them: strided views into one qkv projection output."""
    qkv = _randn(T, (heads + 2 * kv_heads) * head_dim, seed=seed, dtype=dtype)
    q = qkv[:, : heads * head_dim].reshape(T, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(T, kv_heads, head_dim)
    return q, k


def _shuffled_positions(T: int, max_position: int, seed: int) -> torch.Tensor:
    return torch.randperm(max_position, generator=torch.Generator().manual_seed(seed))[:T].to(TEST_DEVICE)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_matches_torch(head_dim, partial, heads, kv_heads, scaling):
    max_position = 512
    rope = _rope(head_dim, max_position, 10000.0, scaling, partial)
    T = 11
    q, k = _qk_views(T, heads, kv_heads, head_dim, seed=heads * head_dim)
    q_before, k_before = q.clone(), k.clone()
    positions = _shuffled_positions(T, max_position, seed=head_dim)
    q_out, k_out = kernels.apply_rotary(positions, q, k, rope.cos_cached, rope.sin_cached, rope.rotary_dim)
    ref_q, ref_k = _torch(rope, positions, q, k)
    _assert_close(q_out, ref_q, torch.float32)
    _assert_close(k_out, ref_k, torch.float32)
    # The tail past rotary_dim is copied bit for bit, and the inputs are left alone.
    assert torch.equal(q_out[..., rope.rotary_dim :], q[..., rope.rotary_dim :])
    assert torch.equal(k_out[..., rope.rotary_dim :], k[..., rope.rotary_dim :])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rotary_on_head_major_layout():
    """q/k viewed from [heads, T, D] buffers: token and head strides both differ from D."""
    rope = _rope(64, 64, 10000.0, None, 0.5)
    T = 5
    q = _randn(6, T, 64, seed=13).transpose(0, 1)
    k = _randn(2, T, 64, seed=14).transpose(0, 1)
    positions = _shuffled_positions(T, 64, seed=3)
    q_out, k_out = kernels.apply_rotary(positions, q, k, rope.cos_cached, rope.sin_cached, rope.rotary_dim)
    ref_q, ref_k = _torch(rope, positions, q, k)
    _assert_close(q_out, ref_q, torch.float32)
    _assert_close(k_out, ref_k, torch.float32)


def test_rotary_single_token_at_a_large_position():
    """Decode of one token: the cache row is picked by the position, not the token index."""
    rope = _rope(64, 4096, 500000.0, LLAMA3_SCALING)
    q, k = _qk_views(1, 4, 2, 64, seed=5)
    positions = torch.tensor([4000], device=TEST_DEVICE)
    q_out, k_out = kernels.apply_rotary(positions, q, k, rope.cos_cached, rope.sin_cached, rope.rotary_dim)
    ref_q, ref_k = _torch(rope, positions, q, k)
    _assert_close(q_out, ref_q, torch.float32)
    _assert_close(k_out, ref_k, torch.float32)
    assert not torch.allclose(q_out, _torch(rope, torch.tensor([0], device=TEST_DEVICE), q, k)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_half_precision(dtype, partial):
    rope = _rope(128, 256, 10000.0, None, partial)
    q, k = _qk_views(7, 8, 2, 128, seed=9, dtype=dtype)
    positions = _shuffled_positions(7, 256, seed=1)
    q_out, k_out = kernels.apply_rotary(positions, q, k, rope.cos_cached, rope.sin_cached, rope.rotary_dim)
    ref_q, ref_k = _torch(rope, positions, q, k)
    _assert_close(q_out, ref_q, dtype)
    _assert_close(k_out, ref_k, dtype)


# ----------------------------------------------------------------------------- dispatch


def test_cpu_tensors_take_the_torch_path():
    assert fused.kernels_for(torch.zeros(2, 4)) is None


def test_switch_and_missing_triton_force_the_torch_path(monkeypatch):
    monkeypatch.setattr(fused, "_is_fused_device", lambda x: True)  # pretend we are on CUDA
    x = torch.zeros(2, 4)
    assert fused.kernels_for(x) is kernels
    monkeypatch.setattr(fused, "ENABLED", False)
    assert fused.kernels_for(x) is None
    monkeypatch.setattr(fused, "ENABLED", True)
    monkeypatch.setattr(fused, "_import_kernels", lambda: None)  # as when triton is absent
    assert fused.kernels_for(x) is None


def test_disable_env_var():
    assert fused.enabled_from_env({})
    assert fused.enabled_from_env({fused.DISABLE_ENV: "0"})
    assert not fused.enabled_from_env({fused.DISABLE_ENV: "1"})
    assert not fused.enabled_from_env({fused.DISABLE_ENV: "true"})


def test_layers_call_the_kernels_on_a_fused_device(monkeypatch):
    """RMSNorm.forward / RotaryEmbedding.forward route through the kernels (with the right
    arguments: same results as their torch path) when the device takes the fused path. On the
    GPU the tensors are on CUDA (compiled kernels take no cpu tensors), where the stand-in for
    `_is_fused_device` changes nothing."""
    calls = []

    def spy(name):
        real = getattr(kernels, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    norm = _norm(96, seed=4)
    x, residual = _randn(5, 96, seed=6), _randn(5, 96, seed=7)
    rope = _rope(64, 128, 10000.0, None, 0.5)
    q, k = _qk_views(5, 4, 2, 64, seed=8)
    positions = _shuffled_positions(5, 128, seed=2)
    ref_plain, (ref_out, ref_res) = _torch(norm, x), _torch(norm, x, residual)
    ref_q, ref_k = _torch(rope, positions, q, k)
    assert calls == []  # the reference path never touches the kernels

    monkeypatch.setattr(kernels, "fused_add_rmsnorm", spy("fused_add_rmsnorm"))
    monkeypatch.setattr(kernels, "apply_rotary", spy("apply_rotary"))
    monkeypatch.setattr(fused, "_is_fused_device", lambda t: True)  # pretend we are on CUDA (on the CPU)
    plain, (out, res), (q_out, k_out) = norm(x), norm(x, residual), rope(positions, q, k)
    assert calls == ["fused_add_rmsnorm", "fused_add_rmsnorm", "apply_rotary"]
    assert isinstance(plain, torch.Tensor)
    _assert_close(plain, ref_plain, torch.float32)
    _assert_close(out, ref_out, torch.float32)
    assert torch.equal(res, ref_res)
    _assert_close(q_out, ref_q, torch.float32)
    _assert_close(k_out, ref_k, torch.float32)


def test_serving_without_triton_never_imports_it():
    """A fresh interpreter where `import triton` fails: the layers import, run on the CPU, and
    the gate reports no kernels instead of raising."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from radixserve.layers import fused\n"
        "from radixserve.layers.layernorm import RMSNorm\n"
        "from radixserve.layers.rotary_embedding import RotaryEmbedding\n"
        "x = torch.randn(3, 8)\n"
        "RMSNorm(8)(x, x)\n"
        "RotaryEmbedding(8, 16, 10000.0)(torch.arange(3), x.view(3, 1, 8), x.view(3, 1, 8))\n"
        "assert fused._import_kernels() is None\n"
        "fused._is_fused_device = lambda t: True\n"
        "assert fused.kernels_for(x) is None\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
