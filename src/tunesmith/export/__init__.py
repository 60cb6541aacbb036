"""`tunesmith export`: a model (or model + adapter) -> an on-device artifact, one module per format.

The contract every format module keeps:

    export(model_dir: Path, output: Path, quant: str, group_size: int, max_seq_len: int) -> Path

`model_dir` is a plain HF folder (safetensors + config + tokenizer); the module checks its own `quant` values,
writes what the target runtime needs and returns the path of the artifact. A module whose weights can be chosen
from data also has `calibrated(quant) -> bool`; for those quants (and --calibration-blocks > 0) its export gets
`calibration=`, token blocks from the training split of the data: --data when given, else the data the model was
tuned on as its train run recorded it (`training_run`), else none (round to nearest). A module that names the model
inside its artifact takes `name=` (`model_name`); ollama takes `system=`, the Modelfile's system prompt. This entry
point resolves the model (merging an adapter on the fly into a temporary folder), loads that data and picks the
module.

With --adapter-only the adapter is written alone, by the module's

    export_adapter(adapter_dir: Path, output: Path, model_dir: Path, quant: str, name: str) -> Path

(gguf: a llama.cpp LoRA adapter; mlx: mlx-lm's adapter folder), `model_dir` being the base model it was trained on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tunesmith.errors import TunesmithError

ADAPTER_FORMATS = ("mlx", "gguf")  # the formats with an adapter of their own (export_adapter)
FORMATS = {
    "pte": "tunesmith.export.executorch",
    "gguf": "tunesmith.export.gguf",
    "mlx": "tunesmith.export.mlx",
    "coreml": "tunesmith.export.coreml",
    "ollama": "tunesmith.export.ollama",
    "keras": "tunesmith.export.keras",
}


def format_module(fmt: str):
    """The module that writes `fmt`, or an error that says which formats this install has."""
    if fmt not in FORMATS:
        raise TunesmithError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    name = FORMATS[fmt]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        have = [f for f, m in FORMATS.items() if importlib.util.find_spec(m) is not None]
        raise TunesmithError(
            f"--format {fmt} is not available in this tunesmith ({name} is missing); available: {', '.join(have) or 'none'}"
        ) from None


@contextlib.contextmanager
def model_folder(model: str, adapter: str | None = None) -> Iterator[Path]:
    """A local HF folder for `model`: as it is, or with `adapter` merged into a temporary folder (removed after).
    An empty `model` is the one the adapter was trained on (else the default model)."""
    from tunesmith.lora import base_model_for
    from tunesmith.models import hub_reachable, resolve_model

    if adapter:
        from tunesmith.merge import merge

        with tempfile.TemporaryDirectory(prefix="tunesmith-export-") as tmp:
            yield merge(model, adapter, str(Path(tmp) / "merged"))
        return
    source = resolve_model(base_model_for(model, None))
    if isinstance(source, str):  # a hub id: fetch its files once, as from_pretrained would
        try:
            from huggingface_hub import snapshot_download

            source = Path(snapshot_download(source, local_files_only=not hub_reachable()))  # offline: the cache
        except Exception as e:  # offline, unknown repo, gated: the hub client raises many kinds
            raise TunesmithError(f"could not fetch '{model}' from the hub ({e}); pass a local model folder") from None
    yield Path(source)


def export(cfg) -> Path:
    """The `export` verb (cfg: config.ExportConfig): resolve the model, then the format module writes the artifact."""
    if not cfg.output:
        raise TunesmithError("export needs --output, the file or folder to write (e.g. ship/model.pte)")
    if cfg.max_seq_len < 2:
        raise TunesmithError(f"--max-seq-len must be at least 2, got {cfg.max_seq_len}")
    if cfg.calibration_blocks < 0:
        raise TunesmithError(f"--calibration-blocks must be 0 (round to nearest) or more, got {cfg.calibration_blocks}")
    if cfg.system is not None and (cfg.format != "ollama" or cfg.adapter_only):
        raise TunesmithError("--system sets the system prompt of an Ollama Modelfile: use it with --format ollama, "
                             "or drop it")
    module = format_module(cfg.format)
    if cfg.adapter_only:
        return export_adapter(cfg, module)
    run = training_run(cfg.model, cfg.adapter)
    calibrates = getattr(module, "calibrated", None)
    source = None
    if cfg.calibration_blocks and calibrates is not None and calibrates(cfg.quant):
        source = calibration_source(cfg, run)  # a mistyped --data fails now, before the merge
    with model_folder(cfg.model, cfg.adapter) as model_dir:
        kw = {"backend": cfg.backend} if cfg.format == "keras" else {}
        if source is not None:
            kw["calibration"] = calibration(model_dir, source, cfg.calibration_blocks)
        if cfg.format in ("gguf", "ollama"):
            kw["name"] = model_name(cfg.model, cfg.adapter, model_dir)
        if cfg.format == "ollama":
            kw["system"] = cfg.system if cfg.system is not None else shared_system_prompt(run)
        return module.export(model_dir, Path(cfg.output), cfg.quant, cfg.group_size, cfg.max_seq_len, **kw)


def export_adapter(cfg, module) -> Path:
    """--adapter-only: the adapter in the format's own adapter form, checked against the base model it was
    trained on (which is read, not written)."""
    from tunesmith.lora import base_model_for

    if not cfg.adapter:
        raise TunesmithError("--adapter-only needs --adapter, the PEFT adapter (or run folder) to write")
    if cfg.format not in ADAPTER_FORMATS:
        raise TunesmithError(f"--adapter-only writes {' or '.join(ADAPTER_FORMATS)} adapters; --format {cfg.format} "
                             "has no adapter form (drop --adapter-only to merge the adapter into the model)")
    module.check_adapter_quant(cfg.quant)  # before the base model is fetched
    with model_folder(base_model_for(cfg.model, cfg.adapter)) as model_dir:
        return module.export_adapter(Path(cfg.adapter), Path(cfg.output), model_dir=model_dir, quant=cfg.quant,
                                     name=model_name("", cfg.adapter, model_dir))


# ------------------------------------------------------------------------------ what the train run recorded


@dataclass(frozen=True)
class TrainingRun:
    """The data a model was tuned on, as its train run recorded it (<run>/config.yaml)."""

    folder: Path
    data: str
    seq_len: int
    val_fraction: float


def _run_folders(model: str, adapter: str | None) -> list[Path]:
    """Where the train run behind the exported model may be: the folder that holds the adapter (a run folder holds
    adapter/ and config.yaml; a checkpoint lies in <run>/checkpoints/). For a model folder: the run of the adapter
    it was merged from (tunesmith-merge.json names it, as given to merge, or relative to the run for the demo's
    merged/), then the folder above it (a full fine-tune's <run>/model, the demo's <run>/merged)."""
    if adapter:
        folder = Path(adapter).expanduser().resolve().parent
        return [folder.parent if folder.name == "checkpoints" else folder]
    folder = Path(model).expanduser() if model else None
    if folder is None or not (folder / "config.json").is_file():
        return []
    runs = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        merged_from = json.loads((folder / "tunesmith-merge.json").read_text(encoding="utf-8")).get("adapter")
        for candidate in (Path(merged_from), folder.parent / merged_from) if isinstance(merged_from, str) else ():
            if (candidate / "adapter_config.json").is_file():
                runs += _run_folders("", str(candidate))
                break
    return [*runs, folder.resolve().parent]


def training_run(model: str, adapter: str | None) -> TrainingRun | None:
    """What the train run behind `model` (+ `adapter`) recorded about its data, or None when no run is found."""
    import yaml

    from tunesmith.config import DataConfig

    for folder in _run_folders(model, adapter):
        try:
            recorded = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(recorded, dict) and isinstance(recorded.get("data"), str) and recorded.get("model"):
            return TrainingRun(folder, recorded["data"], int(recorded.get("seq_len", DataConfig.seq_len)),
                               float(recorded.get("val_fraction", DataConfig.val_fraction)))
    return None


def calibration_source(cfg, run: TrainingRun | None) -> tuple[str, int, float] | None:
    """(data, seq_len, val_fraction) GPTQ calibrates on: --data as given, else the data the run was tuned on (its
    own --seq-len and split); None (with a status line saying why) rounds to nearest."""
    from tunesmith.data import check_data_spec
    from tunesmith.progress import status

    if cfg.data:
        check_data_spec(cfg.data)
        return cfg.data, cfg.seq_len, cfg.val_fraction
    rtn = f"{cfg.quant}: every block rounded to nearest"
    if run is None:
        status(f"{rtn}: no --data given and no train run found beside the model to calibrate on its data")
        return None
    try:
        check_data_spec(run.data)
    except TunesmithError as e:
        status(f"{rtn}: the data {run.folder} was tuned on is not readable from here ({e}); give --data to calibrate")
        return None
    return run.data, run.seq_len, run.val_fraction


def calibration(model_dir: Path, source: tuple[str, int, float], n: int) -> list[list[int]]:
    """`n` token blocks spread over the training split of `source` (data, seq_len, val_fraction), tokenized as the
    model does; a status line on stderr names them."""
    from tunesmith.data import describe_part, load_data, source_label
    from tunesmith.models import load_tokenizer
    from tunesmith.progress import status
    from tunesmith.quantize import calibration_blocks

    spec, seq_len, val_fraction = source
    data = load_data(spec, load_tokenizer(str(model_dir)), seq_len, val_fraction)
    blocks = calibration_blocks(data.train, n)
    if not blocks:
        raise TunesmithError(f"{source_label(spec)} has no training blocks to calibrate on; give more data, or "
                             "--calibration-blocks 0 to round to nearest")
    status(f"GPTQ calibrates on {describe_part(data, 'training part', blocks)} (--data, --calibration-blocks)")
    return blocks


def shared_system_prompt(run: TrainingRun | None) -> str | None:
    """The system prompt every record of the run's chat data opens with, or None (some record has none, or
    another one; the data is not chat records; no run)."""
    from tunesmith.data import read_jsonl

    if run is None:
        return None
    path = Path(run.data).expanduser()
    files = [path / "train.jsonl", path / "valid.jsonl"] if path.is_dir() else [path]
    prompts = set()
    for file in (f for f in files if f.suffix == ".jsonl" and f.is_file()):
        try:
            records, _ = read_jsonl(file)
        except TunesmithError:
            return None
        for _, record in records:
            turns = record.get("messages") or record.get("conversations")
            first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
            if (first.get("role") or first.get("from")) != "system":
                return None
            prompts.add(first.get("content", first.get("value")))
    return prompts.pop() if len(prompts) == 1 and isinstance(next(iter(prompts)), str) else None


def model_name(model: str, adapter: str | None, model_dir: Path) -> str:
    """The name an artifact gives the model (GGUF general.name): the fine-tune's run folder for an adapter, else
    the model's own: a built-in alias's hub name, a hub id's name, a .gguf file's stem, a folder's name (its run's,
    for a run's merged/ or model/)."""
    from tunesmith.lora import base_model_for
    from tunesmith.models import BUILTIN_MODELS

    if adapter:
        folder = Path(adapter).expanduser().resolve()
        folder = folder.parent if folder.name == "adapter" else folder
        return folder.parent.parent.name if folder.parent.name == "checkpoints" else folder.name
    spec = base_model_for(model, None)
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec].hub_id.split("/")[-1]
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        path = path.resolve()
        return path.parent.name if path.name in ("merged", "model") else path.name
    return spec.split("/")[-1] if spec else Path(model_dir).name
