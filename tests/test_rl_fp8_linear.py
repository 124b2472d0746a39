"""FP8 base weights + LoRA: forward against transformers' compressed-tensors model, gradients against a
float64 reference, loading without full-precision copies, and PEFT-compatible adapters."""

import pytest
import torch

from fp8kit import convert
from fp8kit.models import build_checkpoint
from fp8kit.quality import load_causal_lm, quiet
from fp8kit.rl import FP8LoRALinear, load_adapter, load_fp8_model, save_adapter
from fp8kit.rl.fp8_linear import dequantize_weight, quantize_activation

IDS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
# Both sides quantize activations and dequantize weights in float32; only summation order may differ.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def fp8_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {s: convert(llama_dir, root / s, scheme=s).out for s in ("dynamic", "block", "tensor")}


@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
def test_forward_equals_transformers_compressed_tensors(fp8_dirs, llama_dir, scheme):
    with quiet(), torch.no_grad():
        theirs = load_causal_lm(fp8_dirs[scheme], torch.float32)(input_ids=IDS).logits
        ours_model = load_fp8_model(fp8_dirs[scheme], dtype=torch.float32, lora_rank=8)
        ours = ours_model(input_ids=IDS).logits
        source = load_causal_lm(llama_dir, torch.float32)(input_ids=IDS).logits
    assert (ours - theirs).abs().max() <= LOGIT_ATOL
    assert (ours - source).abs().max() > 100 * LOGIT_ATOL  # the comparison can tell FP8 from the source
    assert ours_model.fp8_scheme == scheme


def test_activation_quantization_matches_vllm_granularity():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 256)
    for scheme, shape in [("dynamic", (4, 1)), ("block", (4, 2)), ("tensor", (4, 1))]:  # vLLM: per token for tensor
        q, s = quantize_activation(x, scheme)
        assert q.dtype == torch.float8_e4m3fn and s.shape == shape and s.dtype == torch.float32
        deq = (q.float().reshape(4, -1, 128) * s.reshape(4, -1, 1)).reshape(4, 256) if scheme == "block" else q.float() * s
        # e4m3: half an ulp is 2^-4 of the value; subnormals step 2^-9 of the scale
        bound = x.abs() * 2 ** -4 + (s.repeat_interleave(128, 1) if scheme == "block" else s) * 2 ** -10
        assert ((deq - x).abs() <= bound * 1.0001).all()
    # vLLM floors dynamic activation scales at 1 / (448 * 512) (fp8_utils MIN_SCALING_FACTOR): rows (or groups) of
    # tiny or zero values get that scale, and 1e-7 becomes the subnormal code 12 * 2^-9 (1e-7 * 448 * 512 = 0.0229)
    tiny = torch.full((2, 256), 1e-7)
    tiny[1] = 0.0
    for scheme in ("dynamic", "block", "tensor"):
        q, s = quantize_activation(tiny, scheme)
        assert torch.all(s == 1 / (448 * 512)), scheme
        assert torch.all(q[0].float() == 12 / 512) and torch.all(q[1].float() == 0), scheme


@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_match_float64_reference(scheme, dtype):
    g = torch.Generator().manual_seed(2)
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES[scheme], torch.float32)
    layer = FP8LoRALinear(w_q, w_s, scheme, bias=torch.randn(256, generator=g), rank=8, alpha=16, dtype=dtype,
                          backend="reference")
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(256, 8, generator=g) * 0.1)
    x = (torch.randn(3, 5, 384, generator=g)).to(dtype).requires_grad_()
    upstream = torch.randn(3, 5, 256, generator=g).to(dtype)
    (layer(x) * upstream).sum().backward()

    # float64 reference: the input gradient goes straight through the activation quantizer.
    w = dequantize_weight(w_q, w_s, scheme, torch.float64)
    x64 = x.detach().double().requires_grad_()
    a64 = layer.lora_A.detach().double().requires_grad_()
    b64 = layer.lora_B.detach().double().requires_grad_()
    y64 = x64 @ w.t() + (x64 @ a64.t() @ b64.t()) * (16 / 8)  # alpha / rank, not the layer's own value
    (y64 * upstream.double()).sum().backward()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for got, ref in [(x.grad, x64.grad), (layer.lora_A.grad, a64.grad), (layer.lora_B.grad, b64.grad)]:
        assert got.dtype == dtype
        err = (got.double() - ref).norm() / ref.norm()
        assert err < rtol, (scheme, dtype, float(err))
    assert layer.weight.grad is None and not layer.weight.requires_grad


def test_loading_keeps_weights_fp8_and_only_lora_trains(fp8_dirs):
    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.bfloat16, lora_rank=4)
    fp8 = [m for m in model.modules() if isinstance(m, FP8LoRALinear)]
    assert len(fp8) == 14 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    assert not any(isinstance(m, torch.nn.Linear) and "layers" in n for n, m in model.named_modules())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    # No parameter or buffer holds a full-precision copy of a quantized weight.
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.ndim == 2 and t.is_floating_point() and t.dtype != torch.float8_e4m3fn and "weight_scale" not in name:
            assert "lora_" in name or "embed" in name or "lm_head" in name, name
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("lora_A"))


def test_fp8_format_and_llmcompressor_checkpoints(llama_dir, tmp_path):
    # From a float32 source both formats hold float32 scales, hence the same FP8 bytes.
    src = build_checkpoint(tmp_path / "src32", "llama", torch.float32, seed=1)
    out = convert(src, tmp_path / "fp8", scheme="block", format="fp8").out
    with quiet(), torch.no_grad():
        theirs = load_causal_lm(convert(src, tmp_path / "ct", scheme="block").out, torch.float32)(input_ids=IDS).logits
    model = load_fp8_model(out, dtype=torch.float32, lora_rank=0)
    assert model.model.layers[0].mlp.up_proj.weight_scale.shape == (4, 2)  # from weight_scale_inv
    with torch.no_grad():
        assert (model(input_ids=IDS).logits - theirs).abs().max() <= LOGIT_ATOL

    from test_against_llmcompressor import oneshot_fp8

    ref = oneshot_fp8(llama_dir, tmp_path / "llmc", "FP8_DYNAMIC")
    ours = load_fp8_model(convert(llama_dir, tmp_path / "ours", scheme="dynamic").out, dtype=torch.float32)
    theirs = load_fp8_model(ref, dtype=torch.float32)
    theirs.load_state_dict(ours.state_dict())  # same LoRA init, so equal outputs mean equal base weights
    with torch.no_grad():
        assert torch.equal(ours(input_ids=IDS).logits, theirs(input_ids=IDS).logits)


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma3"])
def test_other_architectures(tmp_path, arch):
    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=3)
    out = convert(src, tmp_path / "out", scheme="dynamic").out
    with quiet(), torch.no_grad():
        theirs = load_causal_lm(out, torch.float32)(input_ids=IDS).logits
        ours = load_fp8_model(out, dtype=torch.float32)(input_ids=IDS).logits
    assert (ours - theirs).abs().max() <= LOGIT_ATOL


def _nonzero_lora_b(model):
    """Seeded non-zero LoRA B (zero at initialisation): an adapter whose weights do not reach a module then shows."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))


def test_adapter_round_trips_through_peft(fp8_dirs, llama_dir, tmp_path):
    from peft import PeftModel

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, lora_alpha=8)
    _nonzero_lora_b(model)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(llama_dir))
    with quiet():
        base = load_causal_lm(llama_dir, torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            ours = model.get_submodule(name)
            assert torch.equal(module.lora_A["default"].weight, ours.lora_A)
            assert torch.equal(module.lora_B["default"].weight, ours.lora_B)
            assert module.scaling["default"] == ours.scaling
    peft_model.save_pretrained(tmp_path / "from-peft")
    fresh = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, lora_alpha=8)
    load_adapter(fresh, tmp_path / "from-peft")
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_an_lm_head_adapter_saved_by_peft_loads_back(fp8_dirs, llama_dir, tmp_path):
    """peft's save of an adapter on lm_head adds lm_head's own weight (save_embedding_layers="auto"): load_adapter
    refused it as a tensor of no LoRA module. The model's own weight is taken; another one (a resized vocabulary)
    is refused in one line."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    from fp8kit.errors import Fp8kitError

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, target_modules=["lm_head", "q_proj"])
    _nonzero_lora_b(model)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(llama_dir))
    with quiet():
        base = load_causal_lm(fp8_dirs["dynamic"], torch.float32)
        PeftModel.from_pretrained(base, tmp_path / "adapter").save_pretrained(tmp_path / "from-peft")
    weights = tmp_path / "from-peft" / "adapter_model.safetensors"
    assert "base_model.model.lm_head.base_layer.weight" in load_file(weights)
    fresh = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, target_modules=["lm_head", "q_proj"])
    load_adapter(fresh, tmp_path / "from-peft")
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits)
    tensors = load_file(weights)
    tensors["base_model.model.lm_head.base_layer.weight"] += 1
    save_file(tensors, weights)
    with pytest.raises(Fp8kitError, match=r"lm_head.base_layer.weight is a weight other than the model's lm_head"):
        load_adapter(fresh, tmp_path / "from-peft")


def test_adapter_config_is_honoured(fp8_dirs, tmp_path):
    from fp8kit.errors import Fp8kitError

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, lora_alpha=32)
    save_adapter(model, tmp_path / "a")
    fresh = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4)  # default alpha = r
    load_adapter(fresh, tmp_path / "a")
    assert {m.scaling for m in fresh.modules() if isinstance(m, FP8LoRALinear)} == {8.0}
    other_rank = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=1)
    with pytest.raises(Fp8kitError, match="shape"):
        load_adapter(other_rank, tmp_path / "a")
    save_adapter(model, tmp_path / "a")  # replacing an adapter leaves no temporary folders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_fused_moe_experts_are_reported(tmp_path):
    from fp8kit.errors import Fp8kitError

    src = build_checkpoint(tmp_path / "src", "qwen3_moe", torch.bfloat16, seed=4)
    out = convert(src, tmp_path / "out", scheme="dynamic").out
    with pytest.raises(Fp8kitError, match="MoE"):
        load_fp8_model(out, dtype=torch.float32)


def test_adapter_missing_modules_is_refused(fp8_dirs, tmp_path):
    from fp8kit.errors import Fp8kitError

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, target_modules=["q_proj"])
    save_adapter(model, tmp_path / "q-only")
    everywhere = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4)
    with pytest.raises(Fp8kitError, match="no weights for"):
        load_adapter(everywhere, tmp_path / "q-only")


def _small_layer(scheme="dynamic", backend=None):
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    w_q, w_s = quantize_weight(torch.randn(256, 256, generator=torch.Generator().manual_seed(5)) * 0.05,
                               SCHEMES[scheme], torch.float32)
    return FP8LoRALinear(w_q, w_s, scheme, rank=4, dtype=torch.float32, backend=backend)


def test_backend_argument_and_environment_override(monkeypatch):
    from fp8kit.rl.fp8_linear import pick_backend

    cpu = torch.device("cpu")
    monkeypatch.delenv("FP8KIT_BACKEND", raising=False)
    assert pick_backend(cpu) == "reference"
    monkeypatch.setenv("FP8KIT_BACKEND", "torch")
    assert pick_backend(cpu) == "torch"
    assert pick_backend(cpu, "reference") == "reference"  # the argument wins over the environment
    monkeypatch.setenv("FP8KIT_BACKEND", "reference")
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(6))
    layer = _small_layer()
    assert torch.equal(layer(x), _small_layer(backend="reference")(x))


def test_unknown_backend_is_refused(monkeypatch):
    from fp8kit.errors import Fp8kitError
    from fp8kit.rl.fp8_linear import pick_backend

    with pytest.raises(Fp8kitError, match="expected one of reference, torch, triton, fbgemm, torchao"):
        pick_backend(torch.device("cpu"), "cutlass")
    with pytest.raises(Fp8kitError, match="'cutlass'"):
        _small_layer(backend="cutlass")
    monkeypatch.setenv("FP8KIT_BACKEND", "deepgemm")
    with pytest.raises(Fp8kitError, match="'deepgemm'"):
        _small_layer()(torch.randn(2, 256))


@pytest.mark.parametrize("backend, package, module", [("fbgemm", "fbgemm-gpu-genai", "fbgemm_gpu"),
                                                      ("torchao", "torchao", "torchao")])
def test_missing_kernel_package_is_named(monkeypatch, backend, package, module):
    import sys

    from fp8kit.errors import Fp8kitError
    from fp8kit.rl.fp8_linear import available_backends, pick_backend

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(Fp8kitError, match=f"needs the {package} package.*pip install {package}"):
        pick_backend(torch.device("cpu"), backend)
    with pytest.raises(Fp8kitError, match=f"pip install {package}"):
        _small_layer(backend=backend)
    monkeypatch.setenv("FP8KIT_BACKEND", backend)
    with pytest.raises(Fp8kitError, match=f"pip install {package}"):
        _small_layer()(torch.randn(2, 256))
    report = available_backends("cpu")[backend]
    assert report["package"] == package and report["schemes"] == []
    assert all(package in why for why in report["unsupported"].values())


def test_triton_backend_without_triton_is_refused_when_the_layer_is_built(monkeypatch, tmp_path):
    """backend='triton' (argument or FP8KIT_BACKEND) without the triton package: one line when layers are built or
    a model is loaded, not a ModuleNotFoundError traceback at the first forward."""
    import sys

    from fp8kit import convert
    from fp8kit.errors import Fp8kitError
    from fp8kit.models import build_checkpoint
    from fp8kit.rl import load_fp8_model

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=4)
    out = convert(src, tmp_path / "fp8", scheme="dynamic").out
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(Fp8kitError, match="backend 'triton' needs the triton package.*pip install triton") as e:
        _small_layer(backend="triton")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("FP8KIT_BACKEND", "triton")
    with pytest.raises(Fp8kitError, match="pip install triton"):
        load_fp8_model(out, dtype=torch.float32, lora_rank=4)


def test_available_backends_on_cpu():
    from fp8kit.rl.fp8_linear import available_backends

    report = available_backends("cpu")
    assert set(report) == {"reference", "torch", "triton", "fbgemm", "torchao"}
    assert report["reference"]["schemes"] == ["dynamic", "block", "tensor"]
    assert report["torch"]["schemes"] == [] and "CUDA" in report["torch"]["unsupported"]["block"]


def test_library_backend_support_matrix(monkeypatch):
    """Which (backend, scheme) pairs run where, without the libraries: only the GPU's capability is faked."""
    from fp8kit.rl import kernel_backends

    gpu = torch.device("cuda", 0)
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    torchao = {("torchao", s, d) for s in ("dynamic", "tensor") for d in (bf16, f16, f32)}
    torchao.add(("torchao", "block", bf16))
    expect = {  # capability -> (backend, scheme, dtype) triples that run
        (9, 0): {("fbgemm", s, bf16) for s in ("dynamic", "block", "tensor")} | torchao,
        (10, 0): {("fbgemm", "dynamic", bf16), ("fbgemm", "tensor", bf16)} | torchao,
        (8, 9): torchao,
        (8, 0): set(),
    }
    for capability, runs in expect.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        for backend in ("fbgemm", "torchao"):
            for scheme in ("dynamic", "block", "tensor"):
                for dtype in (bf16, f16, f32):
                    why = kernel_backends.unsupported(backend, scheme, gpu, dtype)
                    runs_here = (backend, scheme, dtype) in runs
                    assert (why is None) == runs_here, (capability, backend, scheme, dtype, why)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "writes bfloat16 only" in kernel_backends.unsupported("fbgemm", "dynamic", gpu, f16)
    assert "SM90" in kernel_backends.unsupported("fbgemm", "block", gpu, bf16)
    assert "CUDA" in kernel_backends.unsupported("torchao", "block", torch.device("cpu"), bf16)


def test_block_layers_run_on_every_fp8_gpu(monkeypatch):
    """cuBLAS scales 128x128 blocks on SM90 only: on SM89 (L4, RTX 40), SM100 and SM120 the built-in backends run
    block layers on fp8kit's Triton GEMM, and without Triton say so instead of listing block as runnable."""
    import sys
    import types

    from fp8kit.rl.fp8_linear import available_backends, cublas_block_scaling

    gpu = torch.device("cuda", 0)
    every = ["dynamic", "block", "tensor"]
    for capability in [(8, 9), (9, 0), (10, 0), (12, 0)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert cublas_block_scaling(gpu) is (capability == (9, 0))
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))  # importable
        report = available_backends(gpu)
        assert report["torch"]["schemes"] == every and report["triton"]["schemes"] == every, (capability, report)
        monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
        report = available_backends(gpu)
        assert report["triton"]["schemes"] == []
        if capability == (9, 0):
            assert report["torch"]["schemes"] == every
        else:
            assert report["torch"]["schemes"] == ["dynamic", "tensor"]
            assert "install triton" in report["torch"]["unsupported"]["block"]


def _block_product_f64(xq, xs, weight, ws):
    """The block GEMM's contract in float64: (xq * xs per 1x128 group) @ (weight * ws per 128x128 block).T, ws with
    ceil(N/128) rows."""
    m, k = xq.shape
    x = (xq.double().reshape(m, -1, 128) * xs.double()[:, :, None]).reshape(m, k)
    w = weight.double() * ws.double().repeat_interleave(128, 0)[:weight.shape[0]].repeat_interleave(128, 1)
    return x @ w.t()


def _fake_block_kernels(monkeypatch, triton_stand_in, cublas: bool) -> None:
    """Replace fp8kit's Triton block GEMM module with a CPU stand-in and say whether this 'GPU' has cuBLAS blocks."""
    import sys
    import types

    from fp8kit.rl import fp8_linear

    kernel = types.ModuleType("fp8kit.rl.triton_block_gemm")
    kernel.block_scaled_mm_triton = triton_stand_in
    monkeypatch.setitem(sys.modules, "fp8kit.rl.triton_block_gemm", kernel)
    monkeypatch.setattr(fp8_linear, "cublas_block_scaling", lambda device: cublas)


@pytest.mark.parametrize("fp8_backward", [False, True])
def test_block_gemm_off_sm90_goes_to_the_triton_kernel(monkeypatch, fp8_backward):
    """Where cuBLAS cannot scale blocks, the forward and the FP8 input-gradient GEMMs call
    triton_block_gemm.block_scaled_mm_triton with its documented operands (x [M, K] with scales [M, K/128], weight
    [N, K] with scales [N/128, K/128]); here a float64 stand-in with that contract replaces the Triton kernel on the
    CPU, and the layer must compute the reference backend's function."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    calls = []

    def stand_in(xq, weight, xs, ws, out_dtype):
        (m, k), n = xq.shape, weight.shape[0]
        assert xs.shape == (m, k // 128) and ws.shape == (-(-n // 128), k // 128), (xq.shape, weight.shape, xs.shape,
                                                                                   ws.shape)
        calls.append((m, n, k))
        return _block_product_f64(xq, xs, weight, ws).to(out_dtype)

    _fake_block_kernels(monkeypatch, stand_in, cublas=False)
    g = torch.Generator().manual_seed(7)
    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES["block"], torch.float32)
    x = torch.randn(2, 5, 384, generator=g)
    up = torch.randn(2, 5, 256, generator=g)
    out = {}
    for backend in ("reference", "torch"):
        layer = FP8LoRALinear(w_q, w_s, "block", rank=4, dtype=torch.float32, backend=backend,
                              fp8_backward=fp8_backward)
        with torch.no_grad():
            layer.lora_A.copy_(torch.randn(4, 384, generator=torch.Generator().manual_seed(9)) * 0.05)
            layer.lora_B.copy_(torch.randn(256, 4, generator=torch.Generator().manual_seed(8)))
        xx = x.clone().requires_grad_()
        y = layer(xx)
        (y * up).sum().backward()
        out[backend] = (y, xx.grad)
    assert calls == [(10, 256, 384)] + ([(10, 384, 256)] if fp8_backward else [])
    for a, b in zip(out["torch"], out["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_block_layer_with_a_partial_row_block_takes_the_exact_gradient_under_fp8_backward(monkeypatch):
    """Out features 200 (a partial last 128-row block, as fp8-format checkpoints may have): the forward runs the
    block GEMM with ceil(200/128) scale rows; with fp8_backward the output gradient cannot split into 1x128 groups,
    so the input gradient is the exact one (it failed on a reshape)."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    _fake_block_kernels(monkeypatch, lambda xq, weight, xs, ws, out_dtype: _block_product_f64(xq, xs, weight, ws)
                        .to(out_dtype), cublas=False)
    g = torch.Generator().manual_seed(3)
    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES["block"], torch.float32)
    w_q = w_q[:200].contiguous()
    x = torch.randn(3, 384, generator=g)
    up = torch.randn(3, 200, generator=g)
    grads = []
    for backend, fp8_backward in (("reference", False), ("torch", True)):
        layer = FP8LoRALinear(w_q, w_s, "block", rank=0, dtype=torch.float32, backend=backend,
                              fp8_backward=fp8_backward)
        xx = x.clone().requires_grad_()
        (layer(xx) * up).sum().backward()
        grads.append(xx.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
@pytest.mark.parametrize("fp8_backward", [False, True])
def test_widths_not_multiples_of_16_compute_from_dequantized_operands(monkeypatch, scheme, fp8_backward):
    """cuBLASLt refuses FP8 operands with a dimension not a multiple of 16: such a layer (100 out, or 200 in) never
    reaches the GEMM kernels (here stand-ins that record their calls, on the CPU) and computes the reference
    backend's function, forward and input gradient; a 128 x 256 layer does reach them."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl import fp8_linear

    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        calls.append("scaled_mm")
        return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)

    def block_stand_in(xq, weight, xs, ws, out_dtype):
        calls.append("block")
        return _block_product_f64(xq, xs, weight, ws).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(fp8_linear, "block_scaled_mm", block_stand_in)
    g = torch.Generator().manual_seed(5)
    for n, k, reaches in [(100, 256, False), (128, 200, False), (128, 256, True)]:
        if scheme == "block" and k % 128:
            continue  # a partial column block is refused at load
        w_q, w_s = quantize_weight(torch.randn(-(-n // 128) * 128, k, generator=g) * 0.05, SCHEMES[scheme],
                                   torch.float32)
        w_q = w_q[:n].contiguous()
        if scheme == "dynamic":
            w_s = w_s[:n]
        x = torch.randn(6, k, generator=g)
        up = torch.randn(6, n, generator=g)
        out = {}
        calls.clear()
        for backend in ("reference", "torch"):
            layer = FP8LoRALinear(w_q, w_s, scheme, rank=0, dtype=torch.float32, backend=backend,
                                  fp8_backward=fp8_backward)
            xx = x.clone().requires_grad_()
            y = layer(xx)
            (y * up).sum().backward()
            out[backend] = (y, xx.grad)
        assert bool(calls) is reaches, (n, k, calls)
        if not reaches:
            for a, b in zip(out["torch"], out["reference"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_block_gemm_without_triton_where_it_is_needed_is_one_line(monkeypatch):
    """SM90 without Triton: a weight with a partial last row block (200 rows), which cuBLAS cannot scale, needs the
    Triton kernel; the error says so."""
    import sys

    from fp8kit.errors import Fp8kitError
    from fp8kit.rl import fp8_linear

    monkeypatch.setitem(sys.modules, "fp8kit.rl.triton_block_gemm", None)
    monkeypatch.setattr(fp8_linear, "cublas_block_scaling", lambda device: True)
    xq, xs = fp8_linear.quantize_activation(torch.randn(4, 384), "block")
    with pytest.raises(Fp8kitError) as e:
        fp8_linear.block_scaled_mm(xq, torch.zeros(200, 384, dtype=torch.float8_e4m3fn), xs, torch.ones(2, 3),
                                   torch.float32)
    assert "pip install triton" in str(e.value) and "4x384 by 200x384" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (7, 384, 2048), (12, 384, 2048), (10, 384, 896), (10, 200, 512)])
def test_block_gemm_on_sm90_hands_cublas_the_scale_layout_torch_checks(monkeypatch, m, n, k):
    """On SM90 the block op calls F.scaled_mm with scales laid out as torch requires (its _meta_registrations.py,
    1x128 x 128x128): activation scales [M, K/128] with strides (1, M); weight scales [L4, N/128] with strides
    (1, L4), L4 = K/128 rounded up to 4 with zero rows (K = 896: 7 blocks, 8 rows); and M a multiple of 4 (one
    token, or 7, padded with zero rows: an H100's cuBLAS refuses others). A partial last row block, which cuBLAS
    cannot scale, goes to the Triton kernel. Stand-ins enforce that contract on the CPU and compute in float64; the
    result must be the float64 product of the dequantized operands."""
    import torch.nn.functional as F

    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl import fp8_linear

    calls = []

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        (mm, kk), nn_ = a.shape, b.shape[1]
        l4 = -(-(kk // 128) // 4) * 4
        assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
        assert nn_ % 128 == 0 and mm % 4 == 0, (mm, kk, nn_)
        assert scale_a.shape == (mm, kk // 128) and scale_a.stride() == (1, mm), (scale_a.shape, scale_a.stride())
        assert scale_b.shape == (l4, nn_ // 128) and scale_b.stride() == (1, l4), (scale_b.shape, scale_b.stride())
        assert not scale_b[kk // 128:].any()  # the padding rows are zero
        calls.append("cublas")
        return _block_product_f64(a, scale_a, b.t(), scale_b.t()[:, :kk // 128]).to(output_dtype)

    def triton(xq, weight, xs, ws, out_dtype):
        calls.append("triton")
        return _block_product_f64(xq, xs, weight, ws).to(out_dtype)

    _fake_block_kernels(monkeypatch, triton, cublas=True)
    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(m + n + k)
    xq, xs = fp8_linear.quantize_activation(torch.randn(m, k, generator=g) * 3, "block")
    rows = -(-n // 128) * 128  # a partial last block (as fp8-format checkpoints may have): quantize padded, keep n
    wq, ws = quantize_weight(torch.randn(rows, k, generator=g) * 0.02, SCHEMES["block"], torch.float32)
    wq = wq[:n].contiguous()
    got = fp8_linear.block_scaled_mm(xq, wq, xs, ws, torch.float32)
    assert calls == ["triton" if n % 128 else "cublas"]
    assert got.shape == (m, n) and got._base is None  # not a view: layers add their bias in place
    want = (fp8_linear._dequantize_activation(xq, xs, "block").double()
            @ fp8_linear.dequantize_weight(wq, ws, "block", torch.float64).t())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
def test_fp8_backward_is_the_fp8_product_of_the_quantized_gradient(scheme):
    """fp8_backward=True: the input gradient is quantize_grad(g) @ W in FP8, within e4m3's rounding of the exact
    one; LoRA gradients are unchanged (they never touch the FP8 weight)."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl.fp8_linear import quantize_grad

    g = torch.Generator().manual_seed(4)
    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES[scheme], torch.float32)
    x = torch.randn(3, 5, 384, generator=g)
    up = torch.randn(3, 5, 256, generator=g) * torch.logspace(-3, 1, 256)  # uneven columns: scales matter
    grads = {}
    for fp8_backward in (False, True):
        layer = FP8LoRALinear(w_q, w_s, scheme, rank=8, dtype=torch.float32, backend="reference",
                              fp8_backward=fp8_backward)
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(256, 8, generator=torch.Generator().manual_seed(5)))
            layer.lora_A.copy_(torch.randn(8, 384, generator=torch.Generator().manual_seed(6)) * 0.05)
        xx = x.clone().requires_grad_()
        (layer(xx) * up).sum().backward()
        grads[fp8_backward] = (xx.grad.double(), layer.lora_A.grad.double(), layer.lora_B.grad.double())
    w = dequantize_weight(w_q, w_s, scheme, torch.float64)
    up2 = up.reshape(-1, 256)
    gq, gs = quantize_grad(up2, w_s, scheme)
    if scheme == "block":
        g_deq = (gq.double().reshape(15, -1, 128) * gs.double()[:, :, None]).reshape(15, 256)
        expected = g_deq @ w
    else:
        expected = (gq.double() * gs.double()) @ w_q.double()
    lora_part = up2.double() @ (layer.lora_B.detach().double() @ layer.lora_A.detach().double()) * layer.scaling
    exact = up2.double() @ w + lora_part
    got = grads[True][0].reshape(15, 384)
    assert (got - (expected + lora_part)).norm() / got.norm() < 1e-6
    err = float((got - exact).norm() / exact.norm())
    assert 1e-4 < err < 0.04, err  # FP8 rounding of the gradient shows, and stays at e4m3's few percent
    assert torch.allclose(grads[True][1], grads[False][1]) and torch.allclose(grads[True][2], grads[False][2])


@pytest.mark.parametrize("scheme,backend", [("dynamic", "reference"), ("block", "reference"), ("tensor", "reference"),
                                            ("dynamic", "torch"), ("tensor", "torch")])  # torch's block GEMM: GPU
def test_fp8_backward_keeps_tiny_output_gradients(scheme, backend):
    """A GRPO loss averages over every completion token, so output gradients of 1e-7 and below are usual. The
    FP8 input gradient must scale with them: vLLM's floor for activation scales (MIN_SCALE) once flattened
    them to zero and a few subnormal codes, and GRPO's gradient norm fell tenfold on an H100
    (evals/results/grpo_gpu_h100_1b_fp8bwd_before_fix.json). Against float64 of the dequantized weight."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    g = torch.Generator().manual_seed(7)
    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES[scheme], torch.float32)
    exact = None
    up = torch.randn(15, 256, generator=g, dtype=torch.float64)
    for magnitude in (1.0, 1e-7, 1e-12):
        layer = FP8LoRALinear(w_q, w_s, scheme, rank=0, dtype=torch.float32, backend=backend, fp8_backward=True)
        x = torch.randn(15, 384, generator=torch.Generator().manual_seed(8)).requires_grad_()
        (layer(x) * (up * magnitude).float()).sum().backward()
        exact = up @ dequantize_weight(w_q, w_s, scheme, torch.float64)
        err = float((x.grad.double() / magnitude - exact).norm() / exact.norm())
        assert err < 0.04, (magnitude, err)  # e4m3's rounding of the gradient, at every magnitude


@pytest.mark.parametrize("fp8_backward", [False, True])
@pytest.mark.parametrize("scheme", ["dynamic", "block"])
def test_compiles_to_the_eager_function(scheme, fp8_backward):
    """torch.compile traces the layer in one graph (quantization in torch ops, LoRA added out of place) and
    computes what eager mode computes; aot_eager runs the traced graphs without code generation."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    g = torch.Generator().manual_seed(7)
    w_q, w_s = quantize_weight(torch.randn(256, 384, generator=g) * 0.05, SCHEMES[scheme], torch.float32)
    layer = FP8LoRALinear(w_q, w_s, scheme, rank=8, dtype=torch.float32, backend="reference",
                          fp8_backward=fp8_backward)
    with torch.no_grad():
        layer.lora_B.normal_(generator=g)
    x = torch.randn(3, 5, 384, generator=g)
    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        xx = x.clone().requires_grad_()
        layer.zero_grad()
        y = fn(xx)
        (y * y).sum().backward()
        results.append((y.detach(), xx.grad, layer.lora_A.grad.clone()))
    for eager, compiled in zip(*results):
        assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-5)


def test_shared_input_is_quantized_once_until_it_changes(monkeypatch):
    """q/k/v read one tensor: one quantization serves all three; an in-place write or a new tensor redoes it."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl import fp8_linear

    calls = []
    real = fp8_linear._quantize_input
    monkeypatch.setattr(fp8_linear, "_quantize_input", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("FP8KIT_FP8_BACKWARD", "1")
    g = torch.Generator().manual_seed(8)
    layers = [FP8LoRALinear(*quantize_weight(torch.randn(64, 128, generator=g), SCHEMES["dynamic"], torch.float32),
                            "dynamic", rank=4, dtype=torch.float32, backend="reference") for _ in range(3)]
    assert all(m.fp8_backward for m in layers)  # from the environment
    x = torch.randn(2, 5, 128, generator=g)
    first = [m(x) for m in layers]
    assert len(calls) == 1
    x.mul_(2)
    second = [m(x) for m in layers]
    assert len(calls) == 2
    assert all(torch.allclose(b, m(x.clone())) for b, m in zip(second, layers))
    assert not any(torch.allclose(a, b) for a, b in zip(first, second))
    # a layer of another granularity reading the same tensor quantizes it its own way (per 1x128 group, not per
    # token): the cache is keyed by it
    dynamic, block = (FP8LoRALinear(*quantize_weight(torch.randn(128, 256, generator=g), SCHEMES[scheme],
                                                     torch.float32), scheme, rank=4, dtype=torch.float32,
                                    backend="reference") for scheme in ("dynamic", "block"))
    y = torch.randn(2, 5, 256, generator=g)
    y[..., :128] *= 1e-3  # the first group far smaller than the row: per token and per group then differ
    dynamic(y)
    assert torch.equal(block(y), block(y.clone()))


def test_unreadable_fp8_backward_setting_is_refused(monkeypatch):
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.errors import Fp8kitError

    w_q, w_s = quantize_weight(torch.randn(64, 128), SCHEMES["dynamic"], torch.float32)
    monkeypatch.setenv("FP8KIT_FP8_BACKWARD", "maybe")
    with pytest.raises(Fp8kitError, match="FP8KIT_FP8_BACKWARD='maybe'"):
        FP8LoRALinear(w_q, w_s, "dynamic", rank=4, dtype=torch.float32, backend="reference")
    monkeypatch.setenv("FP8KIT_FP8_BACKWARD", "0")
    assert not FP8LoRALinear(w_q, w_s, "dynamic", rank=4, dtype=torch.float32, backend="reference").fp8_backward


def test_fast_accumulation_reaches_every_row_wise_gemm(monkeypatch):
    """fast_accum (on unless FP8KIT_FAST_ACCUM=0 or the argument says otherwise) is what torch._scaled_mm gets, in
    the forward GEMM and in the FP8 input-gradient GEMM; recorded here with a float32 stand-in for the CUDA kernel."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.errors import Fp8kitError

    seen = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        seen.append(use_fast_accum)
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    w_q, w_s = quantize_weight(torch.randn(64, 128), SCHEMES["dynamic"], torch.float32)

    def run(**kw):
        seen.clear()
        m = FP8LoRALinear(w_q, w_s, "dynamic", rank=4, dtype=torch.float32, backend="torch", fp8_backward=True, **kw)
        x = torch.randn(3, 128, requires_grad=True)
        m(x).sum().backward()
        return m.fast_accum, list(seen)

    assert run() == (True, [True, True])
    assert run(fast_accum=False) == (False, [False, False])
    monkeypatch.setenv("FP8KIT_FAST_ACCUM", "0")
    assert run() == (False, [False, False])
    assert run(fast_accum=True) == (True, [True, True])
    monkeypatch.setenv("FP8KIT_FAST_ACCUM", "fast")
    with pytest.raises(Fp8kitError, match="FP8KIT_FAST_ACCUM='fast'"):
        run()


def test_fp8_lm_head_loads_as_fp8_and_matches_transformers(llama_dir, tmp_path):
    out = convert(llama_dir, tmp_path / "out", scheme="dynamic", lm_head=True).out
    with quiet(), torch.no_grad():
        theirs = load_causal_lm(out, torch.float32)(input_ids=IDS).logits
        model = load_fp8_model(out, dtype=torch.float32, lora_rank=8)
        ours = model(input_ids=IDS).logits
    assert isinstance(model.lm_head, FP8LoRALinear) and model.lm_head.weight.dtype == torch.float8_e4m3fn
    assert not any("lm_head" in n for n, p in model.named_parameters() if p.requires_grad)  # no LoRA on it
    assert (ours - theirs).abs().max() <= LOGIT_ATOL


def test_inference_mode_computes_what_no_grad_does(fp8_dirs):
    """The shared-input cache keyed on the version counter, which inference tensors lack: every forward failed."""
    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_casting_the_model_leaves_fp8_weights_and_scales_alone(fp8_dirs):
    """.half() turned the frozen FP8 weights into float16 copies (twice the memory) and rounded the float32 scales."""
    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4)
    layers = list(model.modules())
    before = {id(m): (m.weight.clone(), m.weight_scale.clone()) for m in layers if isinstance(m, FP8LoRALinear)}
    model.half()
    for m in layers:
        if isinstance(m, FP8LoRALinear):
            w, s = before[id(m)]
            assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
            assert torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(m.weight_scale, s)
            assert m.lora_A.dtype == torch.float16


@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
def test_autocast_adds_lora_in_the_output_dtype(scheme):
    """Under autocast the LoRA products come out in bfloat16 while the FP8 product is float32: addmm_ failed."""
    layer = _small_layer(scheme)
    with torch.no_grad():
        layer.lora_B.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    # the LoRA path in bfloat16 (8-bit mantissa): a few parts in a thousand of the output's scale
    assert (got.float() - expected).abs().max() <= 1e-2 * expected.abs().max()


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.float16])
def test_lora_in_another_dtype_than_the_activations_is_added_as_peft_adds_it(lora_dtype):
    """peft keeps float32 adapters in a bf16 model (autocast_adapter_dtype): addmm_ failed on the mixed dtypes."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    w_q, w_s = quantize_weight(torch.randn(256, 256, generator=torch.Generator().manual_seed(5)) * 0.05,
                               SCHEMES["dynamic"], torch.bfloat16)
    layer = FP8LoRALinear(w_q, w_s, "dynamic", rank=4, alpha=8, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.lora_B.normal_(generator=torch.Generator().manual_seed(1))
    layer.lora_A.data, layer.lora_B.data = layer.lora_A.data.to(lora_dtype), layer.lora_B.data.to(lora_dtype)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    twin = FP8LoRALinear(w_q, w_s, "dynamic", rank=0, dtype=torch.bfloat16)
    lora = (x.double() @ layer.lora_A.double().t()) @ layer.lora_B.double().t() * 2.0
    expected = twin(x).double() + lora
    assert (got.double() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_an_adapter_is_not_saved_while_disabled_and_a_missing_alpha_is_peft_s_default(fp8_dirs, tmp_path):
    import json

    from fp8kit.errors import Fp8kitError
    from fp8kit.rl.loader import adapters_disabled

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4, lora_alpha=32)
    with adapters_disabled(model), pytest.raises(Fp8kitError, match="adapters are disabled"):
        save_adapter(model, tmp_path / "a")  # it wrote lora_alpha 0.0: an adapter that does nothing
    assert not (tmp_path / "a").exists()
    save_adapter(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    del config["lora_alpha"]  # peft's LoraConfig then takes 8: scaling 8 / 4
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "a" / "adapter_model.safetensors"
    save_file(load_file(weights), weights)  # as an adapter of other tools: no fp8kit stamp in its metadata
    load_adapter(model, tmp_path / "a")
    assert {m.scaling for m in model.modules() if isinstance(m, FP8LoRALinear) and m.rank} == {2.0}


def _outputs_and_grads(model, compiled=False):
    model.zero_grad()
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    logits = fn(input_ids=IDS).logits
    (logits.float() ** 2).mean().backward()
    return [logits.detach()] + [p.grad.clone() for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("scheme", ["dynamic", "block"])
def test_gated_mlps_run_fused_and_compute_transformers_mlp(fp8_dirs, scheme, monkeypatch):
    """Every Llama MLP gets the fused SiLU-multiply-quantize forward; on the CPU (reference backend: the fused
    wiring in torch ops) it computes transformers' MLP to the bit, LoRA gradients included. Traced by torch.compile,
    and on the torch backend (Inductor fuses the quantization itself), the MLP runs transformers' forward."""
    from fp8kit.rl import fp8_mlp

    fused = load_fp8_model(fp8_dirs[scheme], dtype=torch.bfloat16, lora_rank=4)
    plain = load_fp8_model(fp8_dirs[scheme], dtype=torch.bfloat16, lora_rank=4)
    mlps = [m for n, m in fused.named_modules() if n.endswith(".mlp")]
    assert mlps and all("forward" in m.__dict__ for m in mlps)
    for module in plain.modules():
        module.__dict__.pop("forward", None)
    for p in plain.parameters():  # non-zero B, so the down projection's LoRA input h matters
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    fused.load_state_dict(plain.state_dict())
    calls = []
    real = fp8_mlp.silu_mul_quant
    monkeypatch.setattr(fp8_mlp, "silu_mul_quant", lambda *a: calls.append(a[3]) or real(*a))
    for compiled in (False, True):  # traced, LoRA is added out of place (add_lora): compared with plain traced
        want = _outputs_and_grads(plain, compiled)
        assert not calls
        got = _outputs_and_grads(fused, compiled)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        assert calls == ([] if compiled else ["reference"] * len(mlps))
        calls.clear()
    for m in fused.modules():
        if isinstance(m, FP8LoRALinear):
            m.backend = "torch"
    if scheme == "dynamic":  # the torch backend's block GEMM needs a GPU
        with torch.no_grad():
            fused(input_ids=IDS)
        assert not calls


def test_a_fused_mlp_pickles_and_copies_with_its_forward(fp8_dirs, tmp_path):
    """torch.save of a model from load_fp8_model, or of a layer whose MLP got the fused forward, could not be loaded
    back (bound methods of functions their classes lack); a deep copy's forward belongs to the copy."""
    import copy
    import io

    model = load_fp8_model(fp8_dirs["dynamic"], dtype=torch.float32, lora_rank=4)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole model: its save_pretrained was a bound method too
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    whole.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    layer = model.model.layers[0]
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(layer)
    x = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer.mlp(x)
        for other in (loaded, twin):
            assert other.mlp.forward.module is other.mlp
            assert torch.equal(other.mlp(x), want)


def test_mlps_that_are_not_silu_gated_fp8_keep_their_forward(odd_llama_dir, tmp_path):
    """Gemma 3's MLP (GELU) and an MLP the block converter kept in BF16 (width 320) keep transformers' forward."""
    from fp8kit.rl.fp8_mlp import fuse_gated_mlps

    gemma = load_fp8_model(convert(build_checkpoint(tmp_path / "g", "gemma3", torch.bfloat16, seed=3),
                                   tmp_path / "gq", scheme="dynamic").out, dtype=torch.float32)
    odd = load_fp8_model(convert(odd_llama_dir, tmp_path / "oq", scheme="block").out, dtype=torch.float32)
    for model in (gemma, odd):
        mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
        assert mlps and not any("forward" in m.__dict__ for m in mlps)
        assert fuse_gated_mlps(model) == 0


def test_layer_built_by_hand_with_an_unknown_scheme_or_a_misfit_scale_is_one_line():
    """FP8LoRALinear is public: a scheme it does not know computed as per-channel, and a scale of the wrong size or a
    block weight of partial groups failed at the first forward as a torch size error."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.errors import Fp8kitError

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(9))
    channel, block = (quantize_weight(w, SCHEMES[s], torch.float32) for s in ("dynamic", "block"))
    with pytest.raises(Fp8kitError, match=r"scheme 'per-channel': expected one of dynamic, block, tensor"):
        FP8LoRALinear(*channel, "per-channel")
    with pytest.raises(Fp8kitError, match=r"weight_scale of shape \[10, 1\]: dynamic FP8 of a 256x384 weight needs "
                                          r"256 values \(one per output channel\)"):
        FP8LoRALinear(channel[0], channel[1][:10], "dynamic")
    with pytest.raises(Fp8kitError, match=r"block FP8 of a 256x384 weight needs shape \[2, 3\]"):
        FP8LoRALinear(block[0], channel[1], "block")
    with pytest.raises(Fp8kitError, match=r"needs one value"):
        FP8LoRALinear(channel[0], channel[1], "tensor")
    with pytest.raises(Fp8kitError, match=r"2-D float8_e4m3fn"):
        FP8LoRALinear(w, channel[1], "dynamic")
    # K = 320: partial 1x128 activation groups, which neither vLLM's block kernels nor ours compute (the converter
    # keeps such a Linear in BF16); the forward failed with a torch reshape error
    with pytest.raises(Fp8kitError, match=r"block FP8 of a 256x320 weight: in_features must be a multiple of 128 "):
        FP8LoRALinear(block[0][:, :320].contiguous(), block[1], "block")
    with pytest.raises(Fp8kitError, match=r"^rank=-1: expected an integer >= 0"):
        FP8LoRALinear(*channel, "dynamic", rank=-1)
    with pytest.raises(Fp8kitError, match=r"^input of shape \(2, 300\): this FP8 layer takes 384 features"):
        FP8LoRALinear(*channel, "dynamic")(torch.randn(2, 300))
    FP8LoRALinear(block[0], block[1], "block")(torch.randn(2, 384))
