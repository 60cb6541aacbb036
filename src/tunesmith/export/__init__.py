"""`tunesmith export`: a model (or model + adapter) -> an on-device artifact, one module per format.

The contract every format module keeps:

    export(model_dir: Path, output: Path, quant: str, group_size: int, max_seq_len: int) -> Path

`model_dir` is a plain HF folder (safetensors + config + tokenizer); the module checks its own `quant` values,
writes what the target runtime needs and returns the path of the artifact. A module whose weights can be chosen
from data also has `calibrated(quant) -> bool`; for those quants (and --calibration-blocks > 0) its export gets
`calibration=`, token blocks from the training split of --data. This entry point resolves the model (merging an
adapter on the fly into a temporary folder), loads that data and picks the module.

With --adapter-only the adapter is written alone, by the module's

    export_adapter(adapter_dir: Path, output: Path, model_dir: Path) -> Path

(gguf: a llama.cpp LoRA adapter; mlx: mlx-lm's adapter folder), `model_dir` being the base model it was trained on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import tempfile
from collections.abc import Iterator
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
    module = format_module(cfg.format)
    if cfg.adapter_only:
        return export_adapter(cfg, module)
    calibrates = getattr(module, "calibrated", None)
    calibrated = bool(cfg.calibration_blocks and calibrates is not None and calibrates(cfg.quant))
    if calibrated:
        from tunesmith.data import check_data_spec

        check_data_spec(cfg.data)  # before the merge
    with model_folder(cfg.model, cfg.adapter) as model_dir:
        kw = {"backend": cfg.backend} if cfg.format == "keras" else {}
        if calibrated:
            kw["calibration"] = calibration(model_dir, cfg)
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
    with model_folder(base_model_for(cfg.model, cfg.adapter)) as model_dir:
        return module.export_adapter(Path(cfg.adapter), Path(cfg.output), model_dir=model_dir)


def calibration(model_dir: Path, cfg) -> list[list[int]]:
    """--calibration-blocks token blocks spread over the training split of --data, tokenized as the model does;
    a status line on stderr names them."""
    from tunesmith.data import describe_part, load_data, source_label
    from tunesmith.models import load_tokenizer
    from tunesmith.progress import status
    from tunesmith.quantize import calibration_blocks

    data = load_data(cfg.data, load_tokenizer(str(model_dir)), cfg.seq_len, cfg.val_fraction)
    blocks = calibration_blocks(data.train, cfg.calibration_blocks)
    if not blocks:
        raise TunesmithError(f"{source_label(cfg.data)} has no training blocks to calibrate on; give more data, or "
                             "--calibration-blocks 0 to round to nearest")
    status(f"GPTQ calibrates on {describe_part(data, 'training part', blocks)} (--data, --calibration-blocks)")
    return blocks
