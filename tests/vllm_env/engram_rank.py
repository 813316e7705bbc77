"""One rank of a real gloo world of vLLM 0.33 processes building DeepSeek V4.1 Engram tables (engram_world.py).

Real: vLLM 0.33's ParallelEngramEmbedding (every branch of _allocate_weights it takes here, DPSharedEngramStorage
included), EngramLayout from the checkpoint's config.json, VllmConfig with a real ParallelConfig (DP x TP, gloo, the
Engram DP group built by vLLM's own initialize_model_parallel for DeepseekV41ForCausalLM), EngramConfig with its own
dp_shared_memory resolution, the model module's can_share_engram_tables, vLLM's weight iterator, the real
DeepseekV4 weights mapper and DeepseekV4Model.load_weights (unbound, on a module holding the layers' Engram tables;
only the checkpoint's Engram tensors are fed to it, as the other tensors have no parameter here), and pled's plugin
as vLLM loads it.

FAKED, because this machine has no GPU (the test that runs this says so too):
- the CUDA runtime pled's GPU side calls (pled.client.gpu.use(FakeCuda()), ple_rank.FakeCuda): records each call;
- torch.cuda.cudart()'s cudaHostRegister/Unregister for upstream's own branches (recorded by the same fake);
- Tensor.is_pinned: true where the storage lies in a registered range or a pin_memory allocation;
- torch.accelerator.current_device_index and torch.cuda.get_device_properties(...).multi_processor_count;
- the UVA view helper (the tensor itself where pinned, else a private copy, as the real helper makes one);
- pin_memory=True in upstream's torch.empty: dropped, the tensor taken as pinned.

Usage: engram_rank.py SPEC_JSON (rank, dp, tp, init, dp_port, vllm_path, checkpoint, cases; see engram_world.py).
"""
import gc
import hashlib
import json
import os
import sys
import time
import traceback
import types

from ple_rank import FakeCuda, mapping_of, rss_anon

DEV_SHM = "/dev/shm"


def install_fakes(fake):
    import torch
    import vllm.utils.torch_utils as torch_utils

    from pled.client import gpu

    gpu.use(fake)
    torch.Tensor.is_pinned = lambda self, device=None: fake.pinned(self.untyped_storage().data_ptr())
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=4)

    class Cudart:  # upstream's own registrations (flags 0): the same fake records them
        def cudaHostRegister(self, ptr, n, flags):
            return types.SimpleNamespace(value=fake.register(ptr, n, flags))

        def cudaHostUnregister(self, ptr):
            return types.SimpleNamespace(value=fake.unregister(ptr))

    torch.cuda.cudart = lambda: Cudart()
    copies: list[int] = []

    def uva_view(tensor):
        if tensor.is_pinned():
            return tensor
        copies.append(tensor.numel() * tensor.element_size())
        return tensor.clone()  # what the real helper's cudaHostAlloc + cudaMemcpy make: a private pinned copy

    torch_utils.get_accelerator_view_from_cpu_tensor = uva_view
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if pin_memory:
            fake.host_allocs[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    torch.empty = empty
    return copies


def shm_files() -> list[str]:
    return sorted(n for n in os.listdir(DEV_SHM) if n.startswith("vllm_engram_"))


def anon_maps() -> dict[tuple[int, int, str], int]:
    """This process's anonymous and /dev/shm mappings: (start, size, name) -> resident bytes (smaps' Rss)."""
    out: dict = {}
    key = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=5)
            if "-" in first[0] and not first[0].endswith(":"):
                lo, hi = (int(x, 16) for x in first[0].split("-"))
                name = first[5].strip() if len(first) > 5 else ""
                key = (lo, hi - lo, name or "anonymous") if not name or name.startswith("/dev/shm") else None
            elif key is not None and first[0] == "Rss:":
                out[key] = int(first[1]) * 1024
    return out


def new_maps(before: dict, at_least: int) -> list[str]:
    """Mappings made since ``before`` holding at least ``at_least`` resident bytes (a private or /dev/shm copy of a
    slice; glibc's arenas reserve 64 MiB mappings that hold next to nothing, so their size is no measure)."""
    return [f"{rss} of {size} {name}" for (lo, size, name), rss in anon_maps().items()
            if (lo, size, name) not in before and rss >= at_least]


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build(config: dict, share: bool, files: list[str]):
    """Every Engram layer of the config as vLLM builds it (Engram._create_embedding's arguments), loaded by the real
    DeepseekV4Model.load_weights from the real mapper's names; (shell module, loaded names, share decision)."""
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.models.deepseek_v41.common import engram as E
    from vllm.models.deepseek_v41.nvidia import model as M

    ns = types.SimpleNamespace(**config)
    layout = E.EngramLayout.from_config(ns)
    ec = get_current_vllm_config().engram_config
    ec.dp_shared_memory = None
    ec.resolve_dp_shared_memory(get_current_vllm_config().parallel_config)
    if ec.dp_shared_memory and share:  # as DeepseekV4Model.__init__ does (M:801-805), through the model's own name
        ec.dp_shared_memory = M.can_share_engram_tables(layout)
    elif not share:
        ec.dp_shared_memory = False
    shell = torch.nn.Module()
    shell.layers = torch.nn.ModuleDict()
    for i, layer_id in enumerate(layout.layer_ids):
        layer = torch.nn.Module()
        layer.engram = torch.nn.Module()
        layer.engram.embed_tokens = E.ParallelEngramEmbedding(
            layout.num_embeddings[i], layout.head_dim, tuple(s for order in layout.primes[i] for s in order),
            cpu_offload=ec.cpu_offload, dp_shared_memory=bool(ec.dp_shared_memory), use_thp=ec.use_thp)
        shell.layers[str(layer_id)] = layer
    shell.get_expert_mapping = lambda: []
    shell.quant_config = None
    shell.use_sequence_parallel = False
    mapper = M._make_deepseek_v4_weights_mapper("fp8")
    names = ((n.removeprefix("model."), t) for n, t in mapper.apply(safetensors_weights_iterator(files, False)))
    loaded = M.DeepseekV4Model.load_weights(shell, ((n, t) for n, t in names if ".engram.embed_tokens." in n))
    return shell, sorted(loaded), bool(ec.dp_shared_memory)


def describe(shell, fake, calls_before: int) -> dict:
    from pled.client import held_files

    st = held_files.current()
    out: dict = {"layers": {}, "calls": [list(c) for c in fake.calls[calls_before:]]}
    for layer_id, layer in shell.layers.items():
        e = layer.engram.embed_tokens
        rec = {"range": [e.vocab_start_idx, e.vocab_end_idx], "rows": e.num_embeddings, "params": {},
               "shared_memory": e._shared_memory is not None, "dp_size": e.dp_size}
        for name in ("weight", "weight_scale_inv"):
            p = getattr(e, name)
            info = {"ptr": p.data_ptr(), "storage": p.untyped_storage().data_ptr(), "dtype": str(p.dtype),
                    "nbytes": p.numel() * p.element_size(), "shape": list(p.shape), "pinned": bool(p.is_pinned()),
                    "mapping": mapping_of(p.data_ptr()), "digest": digest(p)}
            table = st.holding(p.data_ptr()) if st is not None else None
            if table is not None:
                param = "weight" if name == "weight" else "scale"
                a = next(a for a in table.manifest.arrays
                         if a.prefix == f"layers.{layer_id}.engram.embed" and a.param == param)
                info["expected"] = table.address + a.offset + e.vocab_start_idx * a.row_bytes
            rec["params"][name] = info
        out["layers"][layer_id] = rec
    return out


def run_case(case: dict, spec: dict, fake, copies) -> dict:
    import torch

    os.environ.pop("PLED_SOCKET", None)
    os.environ.pop("PLED_FALLBACK", None)
    os.environ.update(case.get("env", {}))
    checkpoint = case.get("checkpoint", spec["checkpoint"])
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)["text_config"] | case.get("config", {})
    files = sorted(os.path.join(checkpoint, f) for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    share = case.get("share", True)
    out: dict = {}
    if os.environ.get("PLED_SOCKET") and case.get("warm", True):  # pled's tables attached (mapped, pre-faulted)
        from pled.client import held_files

        start = time.perf_counter()
        try:
            held_files.state()
        except Exception:  # noqa: BLE001 (the case itself says why)
            pass
        out["attach_seconds"] = time.perf_counter() - start
    gc.collect()
    before, calls, copied, shm_before, maps = rss_anon(), len(fake.calls), len(copies), shm_files(), anon_maps()
    start = time.perf_counter()
    try:
        shell, out["loaded"], out["shared"] = build(config, share, files)
        out["seconds"] = time.perf_counter() - start
    except BaseException as err:  # noqa: BLE001 (an AssertionError of upstream's is a result here)
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()[-3000:]
        return out
    out["rss_anon_growth"] = rss_anon() - before
    out["uva_private_copies"] = copies[copied:]
    out["shm_files_made"] = [n for n in shm_files() if n not in shm_before]
    out.update(describe(shell, fake, calls))
    slice_bytes = min(rec["params"]["weight"]["nbytes"] for rec in out["layers"].values())
    out["big_new_maps"] = new_maps(maps, slice_bytes)
    if case.get("uva", True):
        for layer in shell.layers.values():
            e = layer.engram.embed_tokens
            views = e._storage()  # the module's own UVA helper (pled's guard around it)
            out.setdefault("views_same", []).append([v.data_ptr() for v in views] ==
                                                    [e.weight.data_ptr(), e.weight_scale_inv.data_ptr()])
    spec.setdefault("_kept", []).append(shell)
    if case.get("upstream"):
        socket = os.environ.pop("PLED_SOCKET", None)
        try:
            gc.collect()
            before, maps = rss_anon(), anon_maps()
            up, _, out["upstream_shared"] = build(config, share, files)
            out["upstream_rss_anon_growth"] = rss_anon() - before
            out["upstream_big_new_maps"] = new_maps(maps, slice_bytes)
            for layer_id, layer in up.layers.items():
                e = layer.engram.embed_tokens
                mine = shell.layers[layer_id].engram.embed_tokens
                out["layers"][layer_id]["upstream_shared_memory"] = e._shared_memory is not None
                out["layers"][layer_id]["upstream_mapping"] = mapping_of(e.weight.data_ptr())
                out["layers"][layer_id]["equal_to_upstream"] = {
                    n: bool(torch.equal(getattr(mine, n).detach().view(torch.uint8),
                                        getattr(e, n).detach().view(torch.uint8)))
                    and getattr(mine, n).shape == getattr(e, n).shape for n in ("weight", "weight_scale_inv")}
            del up
        finally:
            if socket:
                os.environ["PLED_SOCKET"] = socket
    return out


def setup(spec: dict):
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.engram import EngramConfig

    dp, tp = spec["dp"], spec["tp"]
    pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=spec["rank"] // tp,
                        data_parallel_master_ip="127.0.0.1", data_parallel_master_port=spec["dp_port"])
    pc.data_parallel_master_port = spec["dp_port"]  # as a DP engine hands every rank the same port
    pc._data_parallel_master_port_list = []  # (its own list is of free ports each process drew for itself)
    cfg = VllmConfig(parallel_config=pc)
    cfg.engram_config = EngramConfig(cpu_offload=True)
    # what initialize_model_parallel asks of the model: the architecture builds the Engram DP group
    cfg.model_config = types.SimpleNamespace(architecture="DeepseekV41ForCausalLM", is_moe=False)
    return cfg


def main() -> int:
    import faulthandler

    spec = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(spec.get("hang_seconds", 900), exit=True)  # a hung gloo world says where
    sys.path.insert(0, spec["vllm_path"])
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if spec.get("load_plugins", True):
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    fake = FakeCuda()
    copies = install_fakes(fake)
    import vllm.models.deepseek_v41.common.engram as E
    import vllm.models.deepseek_v41.nvidia.model as M
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = setup(spec)
    tp, rank = spec["tp"], spec["rank"]
    result: dict = {"rank": rank, "cases": {}}
    with set_current_vllm_config(cfg):
        if spec["dp"] > 1:
            ps.init_distributed_environment(tp, rank % tp, None, rank, backend="gloo")
        else:
            ps.init_distributed_environment(tp, rank, spec["init"], rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
        result["edp"] = ps.get_engram_dp_size()
        result["tp_rank"] = ps.get_tensor_model_parallel_rank()
        result["seams"] = {"allocate": getattr(E.ParallelEngramEmbedding._allocate_weights, "__pled__", False),
                           "uva": getattr(E.get_accelerator_view_from_cpu_tensor, "__pled__", False),
                           "share": getattr(M.can_share_engram_tables, "__pled__", False)}
        for case in spec["cases"]:
            for name, value in case.get("load_config", {}).items():
                setattr(cfg.load_config, name, value)
            result["cases"][case["name"]] = run_case(case, spec, fake, copies)
            cfg.load_config.load_format = "auto"
        result["registered_calls"] = len(fake.calls)
        spec.pop("_kept", None)
        gc.collect()
        result["unregistered"] = len(fake.unregistered)
        result["still_registered"] = len(fake.ranges)
    print("PLED-RESULT " + json.dumps(result), flush=True)
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main())
