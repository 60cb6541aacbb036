"""Parity: the same prompts through the same model (+ adapter) on a device and on the CPU, compared.

This is WWDC24's "check that the Metal output matches the CPU": the CPU in fp32 is the reference; the device runs
as `generate` runs it (weights in the precision's dtype). We report logit differences, top-1 agreement and whether
greedy generations match, and fail beyond a tolerance that depends on the precision (docs/MEMORY.md, "Parity").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tunesmith.errors import TunesmithError

DEFAULT_PROMPTS = (
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)


@dataclass(frozen=True)
class Tolerance:
    mean_rel: float  # largest mean of |device - cpu| / max(|cpu|, 1) over every logit
    min_top1: float  # smallest share of positions whose arg-max token agrees


# fp32 kernels differ only in summation order (a GPU against the CPU: a mean of a few 1e-6), so 1e-4 leaves room
# without hiding a real bug. Half precisions round every activation (bf16 keeps 8 bits of mantissa, fp16 11): bf16
# logits drift by a few hundredths on average, on a GPU and on the CPU alike, while the arg-max mostly holds. The maximum is reported, not judged: one logit near zero can move by 1-2
# in bf16 without changing anything downstream. Greedy generations are reported too: in bf16 they part ways
# wherever two tokens were nearly tied, which is expected.
TOLERANCES = {
    "fp32": Tolerance(mean_rel=1e-4, min_top1=0.99),
    "fp16": Tolerance(mean_rel=0.03, min_top1=0.95),
    "bf16": Tolerance(mean_rel=0.1, min_top1=0.90),
}


class ParityMismatch(TunesmithError):
    """The device's output differs from the CPU's beyond the tolerance (exit code 1: a finding, not a misuse)."""

    exit_code = 1


@dataclass
class ParityResult:
    device: str
    precision: str
    positions: int  # logit rows compared
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    top1_agreement: float
    greedy_match: list[bool] = field(default_factory=list)  # per prompt: same greedy tokens on both sides
    first_divergence: list[int | None] = field(default_factory=list)  # first differing generated token, or None
    tolerance: Tolerance = TOLERANCES["fp32"]
    reference: str = "cpu (fp32)"  # what the candidate was compared with

    @property
    def passed(self) -> bool:
        return self.mean_rel <= self.tolerance.mean_rel and self.top1_agreement >= self.tolerance.min_top1

    @property
    def exact(self) -> bool:
        return self.max_abs == 0.0 and all(self.greedy_match)


def compare_logits(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """Differences between two (positions, vocab) logit tensors; relative to max(|ref|, 1) to stay finite near 0."""
    ref, out = ref.double(), out.double()
    diff = (out - ref).abs()
    rel = diff / ref.abs().clamp_min(1.0)
    return {
        "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
        "max_rel": float(rel.max()), "mean_rel": float(rel.mean()),
        "top1_agreement": float((out.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    return model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float().cpu()


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, recomputing the whole sequence each step (no cache: both sides do identical work)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(_logits(model, out)[-1].argmax()))
    return out[len(ids):]


def compare_models(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    prompts: Sequence[list[int]],
    precision: str,
    max_tokens: int = 32,
    tolerance: float = 0.0,
    progress: bool = True,
) -> ParityResult:
    """Run tokenised prompts through both models and compare. Tests pass two small models directly.
    A progress bar per prompt on stderr unless `progress` is False (each is 2 x max_tokens full forward passes)."""
    from tunesmith.progress import steps

    refs, outs, matches, divergences = [], [], [], []
    with steps("parity: prompt", len(prompts), progress) as advance:
        for ids in prompts:
            refs.append(_logits(reference, ids))
            outs.append(_logits(candidate, ids))
            a, b = greedy_tokens(reference, ids, max_tokens), greedy_tokens(candidate, ids, max_tokens)
            matches.append(a == b)
            divergences.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
            advance()
    stats = compare_logits(torch.cat(refs), torch.cat(outs))
    tol = TOLERANCES[precision]
    if tolerance > 0:
        tol = Tolerance(mean_rel=tolerance, min_top1=tol.min_top1)
    device = str(next(candidate.parameters()).device)
    return ParityResult(device, precision, sum(len(r) for r in refs), **stats, greedy_match=matches,
                        first_divergence=divergences, tolerance=tol)


def parity_from_config(cfg, console=None, progress: bool = True) -> ParityResult:
    """The `parity` verb: load once on the CPU in fp32, copy to the device in the precision's dtype, compare."""
    from rich.console import Console

    from tunesmith.data import read_prompts
    from tunesmith.device import DTYPES, resolve_device, resolve_precision
    from tunesmith.lora import base_model_for, load_adapter
    from tunesmith.models import load_model
    from tunesmith.progress import status

    console = console or Console()
    device = resolve_device(cfg.device)
    precision = resolve_precision(device, cfg.precision)
    prompts = read_prompts(cfg.prompts, DEFAULT_PROMPTS)
    spec = base_model_for(cfg.model, cfg.adapter)
    base, tokenizer = load_model(spec, "cpu", torch.float32, cfg.trust_remote_code)
    candidate = copy.deepcopy(base).to(device=device, dtype=DTYPES[precision])
    reference = base
    if cfg.adapter:  # applied to each side, as `generate` applies it (PEFT keeps the adapter in fp32)
        reference, candidate = (load_adapter(reference, cfg.adapter, base=spec),
                                 load_adapter(candidate, cfg.adapter, base=spec))
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    status(f"parity: {len(encoded)} prompts x {cfg.max_tokens} greedy tokens, {spec} on {device} ({precision}) "
           "and on the CPU (fp32)", progress)
    r = compare_models(reference, candidate, encoded, precision, cfg.max_tokens, cfg.tolerance, progress)
    print_result(r, console)
    if not r.passed:
        raise ParityMismatch(
            f"{r.device} ({precision}) differs from the CPU beyond the tolerance: mean relative logit difference "
            f"{r.mean_rel:.3g} (allowed {r.tolerance.mean_rel:g}), top-1 agreement {r.top1_agreement:.1%} "
            f"(needed {r.tolerance.min_top1:.0%})"
        )
    return r


def print_result(r: ParityResult, console) -> None:
    from rich.table import Table

    table = Table(title=f"parity: {r.device} ({r.precision}) vs {r.reference}, {r.positions} positions")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("allowed", justify="right")
    table.add_row("max |logit diff|", f"{r.max_abs:.3g}", "")
    table.add_row("mean |logit diff|", f"{r.mean_abs:.3g}", "")
    table.add_row("max relative diff", f"{r.max_rel:.3g}", "")
    table.add_row("mean relative diff", f"{r.mean_rel:.3g}", f"{r.tolerance.mean_rel:g}")
    table.add_row("top-1 agreement", f"{r.top1_agreement:.2%}", f">= {r.tolerance.min_top1:.0%}")
    table.add_row("greedy generations equal", f"{sum(r.greedy_match)}/{len(r.greedy_match)}", "")
    console.print(table)
    verdict = "exact" if r.exact else ("within tolerance" if r.passed else "BEYOND tolerance")
    console.print(f"parity {verdict}")

