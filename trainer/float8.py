"""float8 training (job config ``precision: fp8``): which linears torchao converts, and why.

`convert` swaps the chosen ``nn.Linear`` modules for torchao's ``Float8Linear`` (tensorwise
dynamic scaling; the rest of the model runs under bf16 autocast, trainer/amp.py) and returns one
`Decision` per linear; `report` is the text the log and the MLflow artifact show. `check_device`
refuses a CUDA GPU without float8 matmuls; `divergence_note` is what a divergence under fp8
adds to its message. torchao is imported here only, inside the functions that need it. The rules
and their reasons: docs/trainer.md, "float8".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainforge.trainer.errors import ConfigError, DivergedError

#: float8 matmuls need every dimension of the operands divisible by 16.
MULTIPLE = 16
#: Too small to gain: in_features <= 4096 and out_features <= 1024 (torchao's tensorwise-scaling
#: heuristic); the casts and scales cost more than the faster matmul saves.
SMALL = (4096, 1024)
#: The LM head stays bf16: its logits feed the loss, where float8's rounding hurts most.
KEEP = ("lm_head",)
#: CUDA compute capability with float8 tensor cores (Ada: L4, L40S; Hopper: H100, H200; later).
MIN_CAPABILITY = (8, 9)
REQUIREMENT = "float8 training needs CUDA GPUs of compute capability 8.9 or higher (H100, H200, L4, L40S, Ada)"
ARTIFACT = "float8_conversion.txt"


@dataclass(frozen=True)
class Decision:
    """What happened to one linear: converted to float8 or kept in bf16, and why."""

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str


def decide(name: str, linear: torch.nn.Linear, small: tuple[int, int] | None = None) -> Decision:
    """Whether ``linear`` (at ``name`` in the model) is worth converting; ``small``: `SMALL`'s bounds."""
    k, n, small = linear.in_features, linear.out_features, small or SMALL

    def keep(reason: str) -> Decision:
        return Decision(name, k, n, False, reason)

    if name.split(".")[-1] in KEEP:
        return keep("LM head: its logits feed the loss")
    if not linear.weight.requires_grad:
        return keep("frozen (not trained)")
    unaligned = [f"{what} {v}" for what, v in (("in_features", k), ("out_features", n)) if v % MULTIPLE]
    if unaligned:
        return keep(f"{' and '.join(unaligned)} not divisible by {MULTIPLE}")
    if k <= small[0] and n <= small[1]:
        return keep(f"too small to gain (in_features <= {small[0]} and out_features <= {small[1]})")
    return Decision(name, k, n, True, "converted")


def plan(model: torch.nn.Module, small: tuple[int, int] | None = None) -> list[Decision]:
    """One `Decision` per ``nn.Linear`` of ``model``, in module order."""
    return [decide(name, m, small) for name, m in model.named_modules() if type(m) is torch.nn.Linear]


def convert(model: torch.nn.Module, device: torch.device, small: tuple[int, int] | None = None
            ) -> list[Decision]:
    """Swap the linears `plan` chooses for torchao's ``Float8Linear``, in place; returns the plan.

    Off CUDA (tests, the CPU) torchao emulates the float8 matmuls: same rounding, no speed-up.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # the fp8 extra

    decisions = plan(model, small)
    chosen = {d.name for d in decisions if d.converted}
    if chosen:
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in chosen,
                                   config=Float8LinearConfig(emulate=device.type != "cuda"))
    return decisions


def report(decisions: list[Decision]) -> str:
    """The conversion report: a summary line, then one line per linear."""
    converted = sum(d.converted for d in decisions)
    lines = [f"float8: {converted} of {len(decisions)} linears converted, {len(decisions) - converted} kept in bf16"]
    lines += [f"  {d.name} ({d.in_features} -> {d.out_features}): "
              f"{'float8' if d.converted else 'bf16'}, {d.reason}" for d in decisions]
    return "\n".join(lines)


def check_device(device: torch.device) -> None:
    """Raise `ConfigError` (exit 78) on a CUDA GPU below `MIN_CAPABILITY`."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"precision 'fp8': {REQUIREMENT}; this job's {torch.cuda.get_device_name(device)} "
                          f"has {capability[0]}.{capability[1]} (expected precision 'bf16' on it)")


def divergence_note(err: BaseException, cfg: object) -> str:
    """What the message of a divergence (`DivergedError`, exit 79) adds under ``precision: fp8``,
    else "": float8 may be its cause, and how to tell."""
    if not isinstance(err, DivergedError) or getattr(cfg, "precision", None) != "fp8":
        return ""
    return ("; under precision fp8 (float8 linears, whose range is far narrower than bf16's): the run stopped "
            "before any checkpoint of that state; resume from the last checkpoint with precision 'bf16' to tell "
            "float8 from the run itself")
