"""Which family an optimizer belongs to, for the estimate's default ``lr_scale``
(docs/estimate.md#the-default-per-optimizer-family): one table from a class's module-qualified name
to its family, read along the class's MRO (a subclass takes its nearest listed base's family).

The table holds names only: nothing here imports an optimizer's package, so a class is found
whether or not its package (bitsandbytes, DeepSpeed's ops) is importable. A class found nowhere in
the table is ``unknown``: the moment family is assumed, and the start-up banner says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

MOMENT = "moment"  # the step is proportional to a gradient moment (Adam-like): lr_scale 2 measured best
SGD = "sgd"  # SGD (with momentum): the step is lr × the momentum buffer; lr_scale 1.5 measured best
NORMALISED = "normalised"  # each coordinate moves by about lr whatever the gradient (sign, RMS clip)

# Measured (docs/bench/optimizers-cpu): torch AdamW, Adam (coupled decay) (moment); torch SGD with momentum
# (sgd); transformers' Adafactor and lion-pytorch's Lion (normalised). The rest are classified by their update rule.
_NORMALISED = (
    "transformers.optimization.Adafactor",  # update RMS-clipped to 1, × lr
    "torch.optim.Adafactor", "torch.optim._adafactor.Adafactor",
    "lion_pytorch.lion_pytorch.Lion", "lion_pytorch.foreach.Lion", "lion_pytorch.cautious_lion.Lion",  # sign(·) × lr
    "deepspeed.ops.lion.fused_lion.FusedLion", "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion",  # "type": "Lion"
    *(f"bitsandbytes.optim.lion.{n}" for n in ("Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit",
                                               "PagedLion32bit")),
)
_MOMENT = (
    *(f"torch.optim.{m}.{n}" for m, n in (("adam", "Adam"), ("adamw", "AdamW"), ("nadam", "NAdam"),
                                          ("radam", "RAdam"), ("adamax", "Adamax"), ("adagrad", "Adagrad"),
                                          ("rmsprop", "RMSprop"), ("sparse_adam", "SparseAdam"))),
    "deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",  # "Adam", "AdamW"
    "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad",
    *(f"bitsandbytes.optim.{m}.{n}" for m, names in (("adam", ("Adam", "Adam8bit", "Adam32bit", "PagedAdam")),
                                                     ("adamw", ("AdamW", "AdamW8bit", "AdamW32bit", "PagedAdamW")))
      for n in names),
)
_SGD = ("torch.optim.sgd.SGD", "apex.optimizers.fused_sgd.FusedSGD")
FAMILIES: Dict[str, str] = {**{n: MOMENT for n in _MOMENT}, **{n: SGD for n in _SGD},
                            **{n: NORMALISED for n in _NORMALISED}}
_WORDS = {MOMENT: "moment", SGD: "SGD", NORMALISED: "normalised-update"}


@dataclass(frozen=True)
class OptimizerFamily:
    """An optimizer's family as the table gives it: ``optimizer`` its class name, ``listed`` the
    qualified name the table matched (None: not in the table, moment assumed)."""

    optimizer: str
    family: str
    listed: str = None

    def words(self) -> str:
        """How the banner names it, e.g. 'Lion: normalised-update family'."""
        if self.listed is None:
            return f"{self.optimizer}: not in the optimizer family table, moment family assumed"
        return f"{self.optimizer}: {_WORDS[self.family]} family"


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def family_of(optimizer) -> OptimizerFamily:
    """The family of ``optimizer`` (an instance or a class): its class's, or its nearest listed base's."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base in cls.__mro__:
        name = qualified_name(base)
        if name in FAMILIES:
            return OptimizerFamily(cls.__name__, FAMILIES[name], name)
    return OptimizerFamily(cls.__name__, MOMENT)
