"""numesh.host.aligned: arrays on a 64-byte boundary, and the buffers that use them."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import self_mesh, tiny_config
from numesh.base.tree import held_bytes
from numesh.host import aligned, threads
from numesh.nn.gpt import init_gpt
from numesh.nn.parts import qkv_grad_buffers


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8])
@pytest.mark.parametrize("shape", [0, 1, 17, (3, 5), (1 << 16, 3), (2, 0, 4)])
def test_arrays_start_on_a_cache_line_with_numpys_shape_dtype_and_values(dtype, shape):
    x = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    made = {"empty": (aligned.empty(shape, dtype), None),
            "zeros": (aligned.zeros(shape, dtype), np.zeros(shape, dtype)),
            "copy": (aligned.copy(x), x), "copy of a transpose": (aligned.copy(x.T), x.T)}
    for what, (a, want) in made.items():
        assert a.size == 0 or a.ctypes.data % aligned.ALIGN == 0, what  # an empty array has no data to place
        assert a.shape == (x.T if what.endswith("transpose") else x).shape, what
        assert a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable, what
        if want is not None:
            np.testing.assert_array_equal(a, want)


def test_a_copy_is_its_own_memory():
    x = np.ones((4, 4), np.float32)
    c = aligned.copy(x[::2])
    c[...] = 2
    assert (x == 1).all() and c.shape == (2, 4)


@pytest.mark.parametrize("kv_heads", [0, 1])
def test_the_qkv_gradients_that_the_attention_adds_into_are_aligned(kv_heads):
    """The attention's tile products accumulate dq, dk and dv in these buffers in place."""
    cfg = tiny_config(n_head=2, n_kv_head=kv_heads, n_embd=16)
    params = init_gpt(cfg, self_mesh(), dtype=np.float32)
    views, storage = qkv_grad_buffers(params.blocks[0].attn, (3, 8), cfg, self_mesh(), np.float32)
    for buf in storage if isinstance(storage, tuple) else (storage,):
        assert buf.ctypes.data % aligned.ALIGN == 0 and not buf.any()
    assert [v.shape for v in views] == [(3, 2, 8, 8), (3, 1 if kv_heads else 2, 8, 8), (3, 1 if kv_heads else 2, 8, 8)]


@pytest.mark.parametrize("rows", [1, 37, 4096])
def test_the_threaded_matmuls_output_is_aligned(rows):
    """The QKV product's output is where the attention's tile products read q, k and v at
    short contexts."""
    a = np.random.default_rng(0).standard_normal((rows, 24)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((24, 40)).astype(np.float32)
    out = threads.matmul(a, b)
    assert out.ctypes.data % aligned.ALIGN == 0
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_the_memory_accounting_counts_an_aligned_arrays_own_bytes():
    """held_bytes (what the activation formulas are held equal to) sees the data, not the
    slack before it: the same count as for numpy's own array, views included."""
    for shape in [(7,), (4, 6), (2, 3, 8)]:
        a, b = aligned.empty(shape, np.float64), np.empty(shape, np.float64)
        assert held_bytes(a) == held_bytes(b) == b.nbytes
        assert held_bytes(a.reshape(-1)[1:], a.T) == b.nbytes
