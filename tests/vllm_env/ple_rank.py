"""One rank of a real gloo world that builds vLLM 0.33's own PLE tables over pled's arrays, and the same tables as
vLLM builds them without pled, and reports both: run by tests/test_vllm_033_ple.py in .venv-vllm, with the 0.33.0
wheel first on sys.path (its CUDA build's Python modules import on this CPU machine; vllm._C is missing).

Real: VllmConfig with a real EngramConfig(cpu_offload=True), Qwen4ExpTextConfig, vLLM's parallel state over gloo
(the embedding group is TP here), Qwen4ExpNGramEmbedding and Qwen4ExpPLEPinnedHostEmbedding, their real
load_weights, vLLM's weight iterator and WeightsMapper, and pled's plugin as vLLM loads it.

FAKED, because this machine has no GPU (the test that runs this says so too):
- the CUDA runtime pled's GPU side calls (pled.client.gpu.use(FakeCuda())): the device's attributes as each case
  sets them, registration results, and the device view at a host address (pageable access); it records each call;
- Tensor.is_pinned: true where the storage lies in a range registered with the fake;
- vLLM's UVA view (vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor, before vLLM's PLE module imports
  it by name): the tensor itself where it is pinned, else a private copy, as the real helper's cudaHostAlloc makes;
- pin_memory=True in upstream's own allocation (torch.empty): dropped, as no accelerator backend exists here, and
  the tensor taken as pinned (as a cudaHostAlloc'd one is).

Usage: ple_rank.py SPEC_JSON (rank, world, init, vllm_path, text, cases; see tests/test_vllm_033_ple.py), or
ple_rank.py sizes TEXT_JSON LAYERS_JSON: each layer's padded rows as vLLM computes them.
"""
import gc
import hashlib
import json
import os
import sys
import time
import traceback

PAGE = os.sysconf("SC_PAGE_SIZE")
EQUAL_CALLS = [0]  # torch.equal calls so far (pled's compare-only loader reads rows with it)


def settle() -> None:
    """Freed memory given back to the kernel (glibc keeps it otherwise, and would hide a new allocation that reuses
    it from RssAnon): a measure of anonymous memory then counts what is held now."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_anon() -> int:
    settle()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (/proc/self/io read_bytes: read(2) and mmap faults
    alike, as safetensors reads a file by mapping it; what the page cache held already does not count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def anonymous_mappings() -> set:
    """This process's anonymous mappings that can hold data (readable or writable, not PROT_NONE reservations)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 and parts[1] != "---p":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.add((lo, hi))
    return out


def mapping_of(ptr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                parts = line.split(maxsplit=5)
                return f"{parts[1]} {parts[5].strip() if len(parts) > 5 else ''}"
    return ""


class FakeCuda:
    """FAKED (no GPU here): pled.client.gpu's runtime; the device's attributes as a case sets them, registration
    results (``refuse``: every registration fails with that code, or only those whose flags are in ``refuse_flags``),
    records register and unregister calls and the device views made at a host address (pageable access)."""

    name = "fake CUDA"

    def __init__(self):
        self.calls, self.unregistered, self.ranges, self.aliases = [], [], {}, []
        self.host_allocs: dict[int, int] = {}  # pin_memory=True allocations: pinned, as cudaHostAlloc's are
        self.read_only, self.refuse, self.pin, self.refuse_flags = True, False, True, None
        self.attrs: dict[int, int] = {}

    def device(self):
        return 0

    def device_name(self, device):
        return "FakeGPU (no read-only registration)" if not self.read_only else "FakeGPU"

    def attribute(self, device, attr):
        return {99: 1, 113: int(self.read_only), 88: 0, 100: 0, 91: 1, **self.attrs}.get(attr, 0)

    def versions(self):
        return 13000, 13000

    def device_alias(self, tensor):
        self.aliases.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor  # the same address, no copy (a real device tensor there is CUDA's)

    def register(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        if self.refuse and (self.refuse_flags is None or flags in self.refuse_flags):
            return 1 if self.refuse is True else self.refuse  # cudaErrorInvalidValue, or the code given
        if self.pin:  # else: says it registered, pins nothing (a runtime pled must not trust blindly)
            self.ranges[ptr] = nbytes
        return 0

    def unregister(self, ptr):
        self.unregistered.append(ptr)
        return 0 if self.ranges.pop(ptr, None) is not None else 1

    def error(self, code):
        return f"fake error {code}"

    def pinned(self, ptr):
        return any(p <= ptr < p + n for p, n in (*self.ranges.items(), *self.host_allocs.items()))


def install_fakes(fake):
    import torch
    import vllm.utils.torch_utils as torch_utils

    from pled.client import gpu

    gpu.use(fake)
    torch.Tensor.is_pinned = lambda self, device=None: fake.pinned(self.untyped_storage().data_ptr())
    copies = []

    def uva_view(tensor):
        if tensor.is_pinned():
            return tensor
        copies.append(tensor.numel() * tensor.element_size())
        return tensor.clone()  # what the real helper's cudaHostAlloc + cudaMemcpy make: a private pinned copy

    torch_utils.get_accelerator_view_from_cpu_tensor = uva_view
    real_equal = torch.equal

    def equal(a, b):  # counted (not faked): a comparison that reads the rows, where identity would not
        EQUAL_CALLS[0] += 1
        return real_equal(a, b)

    torch.equal = equal
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        tensor = real_empty(*args, **kwargs)  # pin_memory dropped: no accelerator backend here,
        if pin_memory:  # but the tensor is taken as pinned, as cudaHostAlloc's memory is on a GPU host
            fake.host_allocs[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    return copies, real_empty, empty


def text_config(text: dict, dtype: str):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**text, ple_embedding_dtype={"bf16": None, "fp8": "float8_e4m3fn",
                                                          "nvfp4": "nvfp4"}[dtype])


def build_and_load(tc, layer: int, params_dtype, files: list[str]):
    import torch
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    prefix = f"model.layers.{layer}.ple.ple_embedding"  # what Qwen4ExpForCausalLM gives the layer
    module = Qwen4ExpNGramEmbedding(tc, int(tc.ple_embed_dim), layer, 64, data_parallel_rank=0, prefix=prefix,
                                    params_dtype=getattr(torch, params_dtype))
    mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."})  # the model's hf_to_vllm_mapper
    weights = ((n[len(prefix) + 1:], t) for n, t in mapper.apply(safetensors_weights_iterator(files, False))
               if n.startswith(prefix + "."))
    loaded = module.load_weights(weights)
    return module, sorted(loaded)


def pinned_params(module) -> dict:
    e = module.ngram_embedding
    names = ["weight", "weight_scale"] if type(e.embedding_method).__name__.endswith("NvFp4EmbeddingMethod") else \
        ["weight"]
    return {n: getattr(e, n) for n in names}


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def describe(module, fake, calls_before: int, digests: bool = True) -> dict:
    """Where each pinned parameter lies, what was registered for it, and a digest of every parameter's bytes."""
    from pled.client import held_files
    from pled.shared.arrays import layer_key

    e = module.ngram_embedding
    st = held_files.current()
    out = {"range": [e.shard_indices.org_vocab_start_index, e.shard_indices.org_vocab_end_index],
           "rows_total": e.num_embeddings_padded, "params": {}, "digests": {},
           "calls": [list(c) for c in fake.calls[calls_before:]]}
    for name, p in dict(e.named_parameters()).items() if digests else ():
        out["digests"][name] = digest(p)
    for name, p in pinned_params(module).items():
        info = {"ptr": p.data_ptr(), "storage": p.untyped_storage().data_ptr(), "nbytes": p.numel() * p.element_size(),
                "pinned": bool(p.is_pinned()), "mapping": mapping_of(p.data_ptr()), "dtype": str(p.dtype),
                "shape": list(p.shape)}
        table = st.holding(p.data_ptr()) if st is not None else None
        if table is not None:
            arrays = [a for t, a in st.arrays.get(layer_key(e.prefix), []) if t is table]
            a = next(a for a in arrays if a.offset <= p.data_ptr() - table.address < a.offset + a.nbytes)
            info["expected"] = table.address + a.offset + e.shard_indices.org_vocab_start_index * a.row_bytes
            info["array"] = f"{a.prefix}.{a.param}"
        method = getattr(e, "embedding_method", None)
        uva = getattr(e, "_uva_weight", None) if name == "weight" else getattr(method, "_uva_weight_scale", None)
        info["uva"] = uva.data_ptr() if uva is not None else None  # what vLLM's lookup kernel reads from
        out["params"][name] = info
    return out


def warm(files: list[str]) -> None:
    """What a process pays once, before the first table is measured: pled's tables attached (their manifests parsed),
    vLLM's iterator and safetensors loaded, the allocator's first arenas. Copies nothing."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from pled.client import held_files

    try:
        held_files.state()
    except Exception:  # the case itself says why
        return
    for _ in safetensors_weights_iterator(files, False):
        pass
    gc.collect()


def guard_refuses(module) -> str:
    """What the module's UVA helper (pled's guard around it) says of a slice of pled's region that is not pinned."""
    from pled.client import held_files

    st = held_files.current()
    if st is None or not st.mapped:
        return "no pled table mapped"
    _, _, table = st.mapped[0]
    a = table.manifest.arrays[0]
    import numpy as np
    import torch

    view = torch.from_numpy(np.frombuffer(table.buffer, dtype=np.uint8, count=a.row_bytes, offset=a.offset))
    try:
        module.get_accelerator_view_from_cpu_tensor(view)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "taken"


def run_case(case: dict, spec: dict, fake, real_empty, fake_empty) -> dict:
    import torch

    os.environ.pop("PLED_SOCKET", None)
    os.environ.pop("PLED_FALLBACK", None)
    os.environ.update(case.get("env", {}))
    fake.read_only, fake.refuse = case.get("read_only", True), case.get("refuse", False)
    fake.pin, fake.attrs = case.get("pin", True), {int(k): v for k, v in case.get("attrs", {}).items()}
    fake.refuse_flags = case.get("refuse_flags")
    from pled.client import gpu

    gpu.use(fake)  # installed anew: the device asked again and the routes chosen again for this case's attributes
    torch.empty = fake_empty if case.get("fake_pin_memory", True) else real_empty
    tc = text_config(spec["text"], case["dtype"])
    files = sorted(os.path.join(case["checkpoint"], f) for f in os.listdir(case["checkpoint"])
                   if f.endswith(".safetensors"))
    out: dict = {"layers": {}}
    kept = spec.setdefault("_kept", [])
    if os.environ.get("PLED_SOCKET") and case.get("warm", True):
        start = time.perf_counter()
        warm(files)
        out["warm_seconds"] = time.perf_counter() - start
    for layer in case["layers"]:
        rec: dict = {}
        out["layers"][str(layer)] = rec
        gc.collect()
        before, calls, copied = rss_anon(), len(fake.calls), len(spec["_copies"])
        anon_before, aliases = anonymous_mappings(), len(fake.aliases)
        read_before, start, equal_before = read_bytes(), time.perf_counter(), EQUAL_CALLS[0]
        try:
            module, rec["loaded"] = build_and_load(tc, layer, case.get("params_dtype", "bfloat16"), files)
            rec["seconds"] = time.perf_counter() - start  # from construction to loaded
            rec["rows_compared"] = EQUAL_CALLS[0] - equal_before  # 0 where each tensor was pled's own rows
            rec["read_bytes"] = read_bytes() - read_before
        except Exception as err:
            rec["error"] = f"{type(err).__name__}: {err}"
            rec["traceback"] = traceback.format_exc()[-3000:]
            continue
        gc.collect()
        rec["rss_anon_growth"] = rss_anon() - before
        rec["uva_private_copies"] = spec["_copies"][copied:]
        rec["new_anonymous_mappings"] = sorted(hi - lo for lo, hi in anonymous_mappings() - anon_before)
        rec["aliases"] = fake.aliases[aliases:]
        rec.update(describe(module, fake, calls, digests=not case.get("lean")))
        kept.append(module)
        if case.get("upstream"):  # the same table as vLLM builds it without pled (only pin_memory faked)
            socket = os.environ.pop("PLED_SOCKET", None)
            gc.collect()
            before, copied = rss_anon(), len(spec["_copies"])
            try:
                upstream, _ = build_and_load(tc, layer, case.get("params_dtype", "bfloat16"), files)
                gc.collect()
                rec["upstream_rss_anon_growth"] = rss_anon() - before
                rec["upstream_uva_private_copies"] = spec["_copies"][copied:]
                rec["upstream_digests"] = {n: digest(p) for n, p in upstream.ngram_embedding.named_parameters()}
                rec["equal_to_upstream"] = {
                    n: bool(torch.equal(p.detach().view(torch.uint8), getattr(upstream.ngram_embedding, n).detach()
                                        .view(torch.uint8)))
                    for n, p in module.ngram_embedding.named_parameters()}
                del upstream
            finally:
                if socket:
                    os.environ["PLED_SOCKET"] = socket
    return out


def main() -> int:
    if sys.argv[1] == "sizes":
        sys.path.insert(0, sys.argv[4])
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
        from vllm.utils.math_utils import round_up

        text, layers = json.loads(sys.argv[2]), json.loads(sys.argv[3])
        heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
        rows = {}
        for layer in layers:
            *_, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
                ngram_vocab_size_base=text["ngram_vocab_size_base"], ngram_heads=heads, ple_dense_layer_id=layer)
            rows[layer] = round_up(total, text["make_ngram_vocab_size_divisible_by"])
        print("PLED-RESULT " + json.dumps(rows))
        return 0
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["vllm_path"])
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if spec.get("load_plugins", True):
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # as every vLLM process does: pled's register() where VLLM_PLUGINS allows it
    fake = FakeCuda()
    copies, real_empty, fake_empty = install_fakes(fake)
    spec["_copies"] = copies
    import vllm.models.qwen4_exp.common.ngram_embedding as pinned_module
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig()
    cfg.engram_config = EngramConfig(cpu_offload=True)
    cfg.parallel_config.tensor_parallel_size = spec["world"]
    result: dict = {"rank": spec["rank"], "cases": {}}
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(spec["world"], spec["rank"], spec["init"], spec["rank"], backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=spec["world"], backend="gloo")
        result["etp"] = [ps.get_etp_group().rank_in_group, ps.get_etp_group().world_size]
        result["seams"] = {
            "allocate": getattr(pinned_module.Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight, "__pled__",
                                False),
            "uva": getattr(pinned_module.get_accelerator_view_from_cpu_tensor, "__pled__", False)}
        for case in spec["cases"]:
            result["cases"][case["name"]] = run_case(case, spec, fake, real_empty, fake_empty)
        result["registered_calls"] = len(fake.calls)
        spec.pop("_kept", None)
        spec.pop("_copies", None)
        gc.collect()  # every module built is gone: their registrations are released by the finalizers
        result["unregistered"] = len(fake.unregistered)
        result["guard"] = guard_refuses(pinned_module)  # pled's tables still mapped, nothing registered now
        result["still_registered"] = len(fake.ranges)
    print("PLED-RESULT " + json.dumps(result), flush=True)
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main())
