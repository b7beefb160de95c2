"""The fine-tune case's own arguments (FinetuneArguments: the task, the model and its pretraining),
read by the task, the pretraining and the run (benchmarks/finetune.py, whose docstring the help
texts refer to); the Trainer's own arguments come separately."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class FinetuneArguments:
    """The task, the model and its pretraining (the Trainer's own arguments come separately)."""

    variant: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "name of this run's variant in the table (default: 'stock' without an enabled acco block, else 'acco')"})
    record: Optional[str] = dataclasses.field(default=None, metadata={"help": "write the JSON record here (rank 0)"})
    pretrained_dir: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "pretrained checkpoint: loaded if present (its settings must match), else pretrained and saved "
                "here; default: OUTPUT_DIR/pretrained"})
    passage_words: int = dataclasses.field(default=20, metadata={"help": "words per passage (+ CLS and SEP)"})
    vocab_size: int = dataclasses.field(default=2000, metadata={"help": "words kept (by frequency) + 5 special"})
    passages_per_topic: int = dataclasses.field(default=512, metadata={"help": "passages kept per topic"})
    heldout_per_topic: int = dataclasses.field(default=96, metadata={
        "help": "of those, held out per topic (96 leaves 6 x 416 = 2496 = 39 x 64 training passages: whole "
                "optimizer steps per epoch at 2 ranks x 8 x gas 4)"})
    allow_partial_steps: bool = dataclasses.field(default=False, metadata={
        "help": "run even when an epoch does not end on a whole optimizer step (the Trainer then takes a short "
                "step at each epoch's end, which ACCO does not follow: see the module docstring)"})
    loss_kwargs: str = dataclasses.field(default="auto", metadata={
        "choices": ["auto", "off"],
        "help": "'auto': the Trainer decides whether the model normalises its loss by num_items_in_batch (for "
                "BertForSequenceClassification transformers 5.x wrongly decides yes: logged and optimised losses "
                "are x world size, training ones also x gradient_accumulation_steps); 'off': "
                "trainer.model_accepts_loss_kwargs = False, HF's documented override (true mean loss)"})
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 512
    pretrain_steps: int = dataclasses.field(default=1500, metadata={"help": "MLM steps before the fine-tune"})
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-3
    pretrain_seed: int = 0
