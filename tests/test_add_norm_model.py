"""The model with the fused add + RMSNorm kernel (paxengine/models/norm.py) in place of XLA's ops,
forced on through its interpret mode: SmolLM2 in FP8 (W8A8: the kernel applies the o
projection's scales and hands over FP8 rows; the upcast path: plain rows) and in bf16. Where
nothing rounds to 8 or 16 bits after the norm (float32 activations, upcast path) its logits
equal the oracle path's (the model's own ops); where something does, a last-bit difference of
the norm (its sum's order) flips roundings that 30 layers amplify, so both paths are held to the
float32 model instead: the kernel's logits no further from it than the oracle path's. On the
GPU the kernel runs in the small buckets (ADD_NORM_MAX_ROWS) and wherever its rows feed W8A8
GEMMs; here every step takes it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from paxengine.models import norm, quant
from paxengine.reference import reference_logits

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press"
)


@pytest.fixture
def logits(smollm, monkeypatch):
    """logits(params, path, kernel): teacher-forced over TEXT, every FP8 matmul through `path`,
    the add + norm by the kernel (interpret mode) or by its oracle."""
    ids = smollm.tokenizer.encode(TEXT)
    real = kernels_pallas.add_rms_norm

    def run(params, path, kernel):
        monkeypatch.setattr(quant, "fp8_path", lambda *a: path)
        monkeypatch.setattr(norm, "add_norm_kernel", lambda rows, hidden, quantize=False: kernel)
        monkeypatch.setattr(kernels_pallas, "add_rms_norm", functools.partial(real, interpret=True))
        jax.clear_caches()  # executables traced the other way must not be reused
        return reference_logits(params, smollm.config, ids)

    yield run
    jax.clear_caches()


def _rel(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _no_further_from(truth, kernel, oracle):
    """The kernel path's logits as close to the float32 model's as the oracle path's (measured
    on the CPU: W8A8 0.073 against 0.094, bf16 0.017 against 0.019)."""
    rel_k, rel_o = _rel(kernel, truth), _rel(oracle, truth)
    top1_k = (kernel.argmax(-1) == truth.argmax(-1)).mean()
    top1_o = (oracle.argmax(-1) == truth.argmax(-1)).mean()
    print(f"vs float32: kernel {rel_k:.3f} (top-1 {top1_k:.2f}), oracle {rel_o:.3f} ({top1_o:.2f})")
    assert rel_k <= 1.3 * rel_o + 1e-3 and top1_k >= top1_o - 0.1


def test_fp8_upcast_path_with_the_kernel_equals_the_oracle_path(fp8_params, logits):
    want = logits(fp8_params, "w8a16", kernel=False)
    got = logits(fp8_params, "w8a16", kernel=True)
    assert _rel(got, want) < 1e-4  # measured 2e-6
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_fp8_w8a8_with_the_kernel_is_as_close_to_float32(smollm, fp8_params, logits):
    truth = logits(smollm.params, "w8a16", kernel=False)
    _no_further_from(
        truth, logits(fp8_params, "w8a8", kernel=True), logits(fp8_params, "w8a8", kernel=False)
    )


def test_bf16_with_the_kernel_is_as_close_to_float32(smollm, logits):
    truth = logits(smollm.params, "w8a16", kernel=False)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), smollm.params)
    _no_further_from(
        truth, logits(params, "w8a16", kernel=True), logits(params, "w8a16", kernel=False)
    )


def test_small_and_w8a8_steps_take_the_kernel_on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert norm.add_norm_kernel(1) and norm.add_norm_kernel(norm.ADD_NORM_MAX_ROWS)
    assert not norm.add_norm_kernel(norm.ADD_NORM_MAX_ROWS + 1)
    assert norm.add_norm_kernel(8192, 4096, quantize=True)  # rows going on to W8A8 GEMMs
    assert norm.add_norm_kernel(1, 16384) and not norm.add_norm_kernel(1, 16385)  # wider: XLA
    assert not norm.add_norm_kernel(8192, 16385, quantize=True)
    monkeypatch.setenv("PAXENGINE_KERNEL_ADD_NORM_W8A8", "0")  # the row rule for those too
    assert not norm.add_norm_kernel(8192, 4096, quantize=True)
    assert norm.add_norm_kernel(8, 4096, quantize=True)
    monkeypatch.setenv("PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS", "0")
    assert not norm.add_norm_kernel(1)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.delenv("PAXENGINE_KERNEL_ADD_NORM_W8A8")
    monkeypatch.setenv("PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS", "100000")
    assert not norm.add_norm_kernel(1)  # no GPU: the oracle
    assert not norm.add_norm_kernel(8192, 4096, quantize=True)


def test_fp8_rows_take_only_the_w8a8_path():
    w = quant.quantize_fp8(jax.random.normal(jax.random.PRNGKey(0), (64, 32)))
    x = jax.random.normal(jax.random.PRNGKey(1), (70, 64))
    xq, xs = quant.quantize_rows(x)
    rows = quant.Fp8Rows(xq, xs, x.dtype)
    np.testing.assert_array_equal(quant.matmul_fp8(rows, w, "w8a8"), quant.matmul_fp8(x, w, "w8a8"))
    with pytest.raises(ValueError, match="take the W8A8 path"):
        quant.matmul_fp8(rows, w, "w8a16")
    y, rs, cs = quant.linear_parts(x, w)  # 70 rows: W8A8 on this CPU too
    scaled = (y.astype(jnp.float32) * rs[:, None] * cs[None, :]).astype(x.dtype)
    np.testing.assert_array_equal(scaled, quant.linear(x, w))
    assert quant.takes_fp8_rows(70, [w, w]) and not quant.takes_fp8_rows(70, [w, jnp.ones((64, 8))])
    assert not quant.takes_fp8_rows(8, [w])  # upcast at 8 rows
