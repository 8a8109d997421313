"""The platform seam on this machine: choosing a device (and the errors for one that is not there),
kernels resolved once per layer at build time, backends and quantization methods per platform, the
CUDA memory rule (with torch's CUDA memory queries stubbed), and the rule that layers never test a
tensor's device themselves."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.platforms import building, op_kernels, resolve_platform, torch_ops
from tokenmill.platforms.base import KVMemoryRequest
from tokenmill.platforms.cpu import TORCH_OPS, CPUPlatform
from tokenmill.platforms.cuda import CUDAPlatform

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "tokenmill"


def test_auto_is_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_platform("auto").name == "cpu" and resolve_platform("cpu").device == torch.device("cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_says_what_was_asked_and_what_is_there(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=rf"device '{device}' was asked for, but torch sees no CUDA GPU.*device='cpu'"):
        resolve_platform(device)


def test_a_gpu_index_past_the_last_names_the_ones_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3' was asked for, but this machine has 1 CUDA GPU\(s\): cuda:0..cuda:0"):
        resolve_platform("cuda:3")
    assert resolve_platform("cuda:0").device == torch.device("cuda", 0)


@pytest.mark.parametrize("device", ["tpu", "cpu:1", "cuda:x", "", "CUDA", 0, None])
def test_unknown_devices_are_refused(device):
    with pytest.raises(ValueError, match="device"):
        resolve_platform(device)


def test_the_engine_refuses_a_missing_gpu_before_loading_anything(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        LLM(tiny_model_dir, device="cuda")


def test_layers_get_their_kernels_when_built():
    from tokenmill.layers.norm import RMSNorm
    cpu = CPUPlatform(torch.device("cpu"))
    with building(cpu, torch.bfloat16):
        norm = RMSNorm(8, 1e-5, torch.bfloat16)
    assert norm.kernel is torch_ops.rms_norm                    # the native kernels are float32 only
    with building(cpu, torch.float32):
        assert op_kernels() is cpu.op_kernels(torch.float32)    # resolved once per (platform, dtype)
    assert CUDAPlatform(torch.device("cuda", 0)).op_kernels(torch.bfloat16).rotary is torch_ops.rotary


def test_backends_and_methods_belong_to_a_platform():
    cpu, cuda = CPUPlatform(torch.device("cpu")), CUDAPlatform(torch.device("cuda", 0))
    assert cpu.attention_backend_name("auto") == "cpu" and cuda.attention_backend_name("auto") == "triton"
    with pytest.raises(ValueError, match=r"attention backend 'cpu' does not run on cuda; expected one of \['triton', 'reference'\]"):
        cuda.attention_backend_name("cpu")
    assert cuda.quant_method("int4", torch.bfloat16).name == "int4" and cuda.quant_method(None, torch.bfloat16).is_float
    with pytest.raises(ValueError, match=r"unknown quantization 'w8a8' on cuda; supported there: fp8, int4, int8, mxfp4, nvfp4"):
        cuda.quant_method("w8a8", torch.bfloat16)


def test_torch_kernels_give_the_native_kernels_tokens(tiny_model_factory, monkeypatch):
    """The same model through the CPU's native elementwise kernels and through torch_ops."""
    model_dir = tiny_model_factory("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [[11, 220, 4890, 17], [7, 8, 9, 10, 11, 12]]

    def run():
        llm = LLM(model_dir, kv_cache_memory_bytes=1 << 22, block_size=4, enable_prefix_caching=False)
        return [(o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    native = run()
    monkeypatch.setattr(CPUPlatform, "op_kernels", lambda self, dtype: TORCH_OPS)
    portable = run()
    for (ta, la), (tb, lb) in zip(native, portable):
        assert ta == tb and max(abs(a - b) for a, b in zip(la, lb)) < 1e-4


def _cuda_memory(monkeypatch, free_gib: float, total_gib: float, allocated_gib: float):
    g = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * g), int(total_gib * g)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated_gib * g))


def test_cuda_kv_budget_is_utilization_less_what_is_used_and_the_activations(monkeypatch):
    _cuda_memory(monkeypatch, free_gib=124, total_gib=140, allocated_gib=15)     # 16 GiB in use
    cuda = CUDAPlatform(torch.device("cuda", 0))
    got = cuda.kv_cache_bytes(KVMemoryRequest(None, 0.25, 0.9, activation_bytes=2 * 2 ** 30))
    assert got == int(0.9 * 140 * 2 ** 30) - 16 * 2 ** 30 - 2 * 2 ** 30
    assert cuda.kv_cache_bytes(KVMemoryRequest(2 ** 30, 0.25, 0.9, 0)) == 2 ** 30     # explicit size


def test_cuda_out_of_memory_says_what_took_it_and_what_lowers_it(monkeypatch):
    _cuda_memory(monkeypatch, free_gib=8, total_gib=80, allocated_gib=70)
    cuda = CUDAPlatform(torch.device("cuda", 0))
    with pytest.raises(MemoryError, match=r"weights take 70.00 GiB.*activations need about 1.00 GiB.*8.00 of 80.00 "
                                          r"GiB are free.*--gpu-memory-utilization.*--quantization"):
        cuda.kv_cache_bytes(KVMemoryRequest(None, 0.25, 0.9, activation_bytes=2 ** 30))
    with pytest.raises(MemoryError, match="kv_cache_memory_bytes=21474836480"):
        cuda.kv_cache_bytes(KVMemoryRequest(20 * 2 ** 30, 0.25, 0.9, 0))


def test_no_layer_or_model_tests_a_tensors_device():
    """Dependency rule (DESIGN.md): layers/ and models/ get device-specific kernels from platforms/."""
    pattern = re.compile(r"\.is_cuda\b|\.device\.type\b|cuda\.is_available|cpu_native|tile_kernels")
    backends = {"layers/attention/cpu.py"}       # the CPU platform's attention backend, chosen through it
    offenders = [f"{p.relative_to(SRC)}:{i}" for d in ("layers", "models") for p in (SRC / d).rglob("*.py")
                 if str(p.relative_to(SRC)) not in backends
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


@pytest.mark.parametrize("max_batch,expected", [(1, [1]), (5, [1, 2, 4, 5]), (20, [1, 2, 4, 8, 16, 20]),
                                                (32, [1, 2, 4, 8, 16, 24, 32])])
def test_graph_buckets(max_batch, expected):
    from tokenmill.worker.cuda_graphs import graph_buckets
    assert graph_buckets(max_batch) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_every_parameter(tiny_model_factory, tied):
    from transformers import AutoConfig, AutoModelForCausalLM
    from tokenmill.config import ModelConfig
    from tokenmill.worker.kv_memory import weight_bytes
    model_dir = tiny_model_factory("llama", tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in hf.parameters())           # a tied head counts once
    assert weight_bytes(ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))) == 4 * params


def test_out_of_memory_while_loading_says_what_was_needed(tiny_model_dir, monkeypatch):
    import tokenmill.worker.model_runner as runner

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(runner, "load_and_quantize", no_room)
    with pytest.raises(MemoryError, match=r"ran out of memory loading the weights: the model needs about 0\.\d+ GiB.*"
                                          r"--quantization int8 or int4"):
        LLM(tiny_model_dir, kv_cache_memory_bytes=1 << 22)


def test_cuda_kv_budget_is_measured_after_unreferenced_tensors_are_given_back(monkeypatch):
    """Before mem_get_info: gc.collect() (tensors held only by a cycle) and torch.cuda.empty_cache() (blocks
    PyTorch's allocator caches), or they count as in use and shrink the pool."""
    import gc
    calls = []
    g = 2 ** 30
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or (60 * g, 80 * g))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 15 * g)
    CUDAPlatform(torch.device("cuda", 0)).kv_cache_bytes(KVMemoryRequest(None, 0.25, 0.9, activation_bytes=0))
    assert calls == ["collect", "empty_cache", "mem_get_info"]


def test_the_uni_executor_makes_its_gpu_the_current_device_in_every_thread(monkeypatch):
    """device="cuda:1" in one process: torch.cuda.set_device(1) before the runner is built (Triton launches and
    CUDA graph capture use the current device), and again in a step run from another thread (the current
    device is per host thread); a CPU engine never touches CUDA."""
    import threading
    from types import SimpleNamespace
    from tokenmill.executor import uni
    current = threading.local()
    events = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (events.append(("set_device", d)),
                                                            setattr(current, "index", d)))

    class Runner:
        def __init__(self, config, weights, platform):
            events.append(("runner", torch.cuda.current_device()))

        def execute(self, sched_out):
            events.append(("execute", torch.cuda.current_device()))

    monkeypatch.setattr(uni, "ModelRunner", Runner)
    config = SimpleNamespace(parallel=SimpleNamespace(world_size=1, replicas_sharing_host=1))
    executor = uni.UniExecutor(config, None, CUDAPlatform(torch.device("cuda", 1)))
    executor.execute(None)
    thread = threading.Thread(target=executor.execute, args=(None,))
    thread.start()
    thread.join()
    assert events == [("set_device", 1), ("runner", 1), ("execute", 1), ("set_device", 1), ("execute", 1)]
    for name in ("current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail("a CPU engine asked CUDA"))
    monkeypatch.setattr(uni, "ModelRunner", lambda config, weights, platform: SimpleNamespace(execute=lambda s: "ran"))
    assert uni.UniExecutor(config, None, CPUPlatform(torch.device("cpu"))).execute(None) == "ran"
