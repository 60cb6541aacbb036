"""Weight-only int8 / int4 through torchao, for eager inference on the machine at hand.

int8: one scale per output channel. int4: per group of 32 / 64 / 128 input weights, a scale and (the default affine
grid) a float offset, chosen by GPTQ (gptq.py); v_proj int8 per channel unless told otherwise. Every linear layer is
quantized (lm_head int8; a tied one is untied first) and the embedding table is stored as int8 per row.

The output folder's format (how it is written and read back, GroupOffsetLinear included) is quantformat.py, which
models.py loads such a folder through; this module is the stage: choosing the weights, measuring, the verb.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.quantformat import (
    GroupOffsetLinear,
    import_torchao,
    load_quantized_model,
    save_quantized,
    use_cpu_kernels,
)

SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def check_scheme(scheme: str, group_size: int) -> None:
    if scheme not in SCHEMES:
        raise TunesmithError(f"--scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "int4" and group_size not in GROUP_SIZES:
        raise TunesmithError(f"--group-size for int4 must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def untie_lm_head(model: torch.nn.Module) -> None:
    """Give lm_head its own copy of a tied embedding, so each can be quantized its own way."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


GRIDS = ("affine", "symmetric")
KEEP_8BIT = ("v_proj",)


def quantize_model(model: torch.nn.Module, scheme: str = "int8", group_size: int = 32,
                   calibration: Sequence[Sequence[int]] | None = None, grid: str = "affine",
                   keep_8bit: Sequence[str] = KEEP_8BIT, progress: bool = True) -> dict:
    """Quantize `model` in place (torchao tensors); returns what was done, for tunesmith-quant.json.

    int8: every linear (lm_head too) int8 per output channel, run by torchao's int8 weight-only kernel. int4: the
    decoder layers' linears int4 in groups, chosen by GPTQ when `calibration` (token blocks) is given, else rounded
    to nearest; `grid` affine adds a float offset per group (scale * code + offset, as MLX and llama.cpp's Q4_1 /
    Q4_K store 4 bits), symmetric is XNNPACK's bare grid. Linears named in `keep_8bit` (v_proj by default, as
    llama.cpp's Q4_K_M keeps attn_v at 6 bits) are int8 per channel, also by GPTQ. lm_head int8 per channel (4 bits
    there cost as much perplexity as all the layers' down_proj together). Both schemes: the embedding int8 per row.
    GPTQ shows a progress bar per layer on stderr unless `progress` is False.
    """
    check_scheme(scheme, group_size)
    if grid not in GRIDS:
        raise TunesmithError(f"--grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    quantize_ = import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    untie_lm_head(model)
    model.requires_grad_(False)
    info: dict = {"scheme": scheme, "group_size": group_size if scheme == "int4" else None,
                  "embedding": "int8 per row", "lm_head": "int8 per channel"}
    if scheme == "int8":
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        info.update(method="round to nearest", linear="int8 per channel")
    else:
        info.update(_int4_layers(model, group_size, calibration, grid, tuple(keep_8bit), progress))
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(int8_rows(head.weight), requires_grad=False)
    info["quantized_linear_layers"] = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    return info


def _int4_layers(model, group_size: int, calibration, grid: str, keep_8bit: tuple[str, ...], progress: bool) -> dict:
    """int4 weights for every linear inside model.model.layers: GPTQ with calibration, else round to nearest."""
    from tunesmith import gptq

    if not (hasattr(model, "model") and hasattr(model.model, "layers")):
        raise TunesmithError("int4 needs a decoder-only model with model.model.layers (the Llama / Qwen / Mistral shape)")
    names = {n.rsplit(".", 1)[-1] for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted(set(keep_8bit) - names)
    if unknown:
        raise TunesmithError(f"--keep-8bit names {', '.join(unknown)}, which this model's layers lack; "
                             f"they have {', '.join(sorted(names))}")
    for name, m in model.model.layers.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in keep_8bit and m.in_features % group_size:
            raise TunesmithError(f"layer {name} has {m.in_features} inputs, not a multiple of --group-size {group_size}")
    four = gptq.INT4_AFFINE if grid == "affine" else gptq.INT4

    def plan(name: str, m: torch.nn.Linear):
        return (gptq.INT8, m.in_features) if name.rsplit(".", 1)[-1] in keep_8bit else (four, group_size)

    if calibration:
        done = gptq.gptq_decoder_layers(model, calibration, plan, progress=progress)
        method = {"method": "gptq (act-order, static groups, sequential)", "calibration_blocks": len(calibration)}
    else:
        done = gptq.rtn_decoder_layers(model, plan)
        method = {"method": "round to nearest", "calibration_blocks": 0}
    for name, (g, group, scales, offsets) in done.items():
        m = model.get_submodule(name)
        sym = m.weight.float() - offsets.repeat_interleave(group, dim=1)  # scale * code: XNNPACK's part
        m.weight = torch.nn.Parameter(intx_groups(sym, scales, group, torch.int8 if g is gptq.INT8 else torch.int4),
                                      requires_grad=False)
        if g.affine:
            GroupOffsetLinear.convert(m, group, offsets)
    kind = "affine (scale and offset per group)" if grid == "affine" else "symmetric (scale per group)"
    return {**method, "grid": grid, "linear": f"int4 {kind}, groups of {group_size}",
            "kept_8bit": list(keep_8bit), "affine_layers": sorted(n for n, v in done.items() if v[0].affine)}


def intx_groups(on_grid: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.int4):
    """A torchao int tensor (codes + scales, no zero point) from weights already on the grid (gptq.py) and their
    scales [out, in / group_size]."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    return IntxUnpackedToInt8Tensor.from_hp(
        on_grid.float(), (1, group_size), dtype, intx_choose_qparams_algorithm=None,
        custom_scale=scales.float(), custom_zero_point=torch.zeros_like(scales, dtype=torch.int8),
    )


def int8_rows(weight: torch.Tensor):
    """A torchao int8 tensor, symmetric, one scale per output row (what XNNPACK runs as 8-bit per channel)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor, MappingType

    return IntxUnpackedToInt8Tensor.from_hp(weight.detach().float(), (1, weight.shape[1]), torch.int8,
                                            mapping_type=MappingType.SYMMETRIC)


def weights_bytes(folder: str | Path) -> int:
    """Bytes of a model folder's weight files (safetensors / bin), the part that grows with the model."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


# --------------------------------------------------------------------------------------------- the verb


@dataclass
class Measure:
    bytes: int
    perplexity: float
    tokens_per_s: float


@dataclass
class QuantizeResult:
    output: Path
    scheme: str
    group_size: int
    layers: int
    float: Measure
    quantized: Measure
    scored: str = ""  # the held-out data both perplexities are on
    calibrated: str = ""  # the training data GPTQ chose the int4 weights on


def measure(model, tokenizer, examples, nbytes: int, max_tokens: int, prompt: str = "ROMEO:\n") -> Measure:
    """Perplexity on `examples` and greedy decode tokens/s for one prompt."""
    from tunesmith.evaluate import evaluate
    from tunesmith.generate import stream_generate

    ppl = evaluate(model, examples, 4, 0, tokenizer.pad_token_id).perplexity if examples else float("nan")
    tps = float("nan")
    if max_tokens > 0:
        for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            tps = r.generation_tps
    return Measure(nbytes, ppl, tps)


def calibration_blocks(train: Sequence, n: int) -> list[list[int]]:
    """n token blocks spread evenly over the training split (not the first n: those are one play / one file)."""
    if n <= 0 or not train:
        return []
    step = max(1, len(train) // n)
    return [list(ids) for ids, _ in train[::step][:n]]


def quantize(cfg, progress: bool = True) -> QuantizeResult:
    """The `quantize` verb: load the float model (+ adapter, merged), quantize, save, reload, compare.
    Each stage says what it does on stderr (GPTQ with a bar per layer) unless `progress` is False."""
    from tunesmith.data import check_data_spec, describe_part, load_data, source_label
    from tunesmith.lora import load_with_adapter
    from tunesmith.models import resolve_model
    from tunesmith.progress import status

    check_scheme(cfg.scheme, cfg.group_size)
    if not cfg.output:
        raise TunesmithError("quantize needs --output, the folder for the quantized model")
    import_torchao()
    if cfg.eval_blocks or cfg.calibration_blocks:
        check_data_spec(cfg.data)  # before the model loads
    model, tokenizer, spec = load_with_adapter(cfg.model, cfg.adapter)  # CPU, fp32
    if cfg.adapter:
        from tunesmith.lora import merge_adapter

        model = merge_adapter(model)
    source = resolve_model(spec)
    float_bytes = weights_bytes(source) if isinstance(source, Path) else 0
    data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction) if cfg.eval_blocks or cfg.calibration_blocks else None
    examples = data.valid[: cfg.eval_blocks] if data and cfg.eval_blocks else []
    if cfg.eval_blocks and not examples:
        raise TunesmithError(f"{source_label(cfg.data)} has no held-out blocks of {cfg.seq_len} tokens; lower --seq-len")
    calibration = calibration_blocks(data.train, cfg.calibration_blocks) if data and cfg.scheme == "int4" else None
    scored = describe_part(data, "held-out part", [ids for ids, _ in examples]) if examples else ""
    calibrated = describe_part(data, "training part", calibration) if calibration else ""
    if scored:
        status(f"scoring the float model on {scored}", progress)
    before = measure(model, tokenizer, examples, float_bytes, cfg.max_tokens)
    t = time.perf_counter()
    method = f"GPTQ calibrated on {calibrated}" if calibrated else "round to nearest"
    status(f"quantizing {spec} to {cfg.scheme} ({method})", progress)
    keep = tuple(k for k in cfg.keep_8bit.split(",") if k)
    info = quantize_model(model, cfg.scheme, cfg.group_size, calibration, cfg.grid, keep, progress)
    info.update(source=str(spec), adapter=str(cfg.adapter) if cfg.adapter else None,
                seconds=round(time.perf_counter() - t, 1))
    out = save_quantized(model, tokenizer, cfg.output, info)
    del model
    reloaded = load_quantized_model(out)  # measure what was written, not what is in memory,
    use_cpu_kernels(reloaded)  # run as generate and eval run it on the CPU
    if scored:
        status(f"scoring the {cfg.scheme} model as saved in {out}", progress)
    after = measure(reloaded, tokenizer, examples, weights_bytes(out), cfg.max_tokens)
    return QuantizeResult(out, cfg.scheme, cfg.group_size, info["quantized_linear_layers"], before, after, scored,
                          calibrated)
