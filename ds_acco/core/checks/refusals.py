"""What ACCO refuses, why, and the fix: one table, and the checks of what the caller asked for.

Every refusal is a row of :data:`REFUSALS` (a key, the setting refused, the reason, the fix). A check
raises an :class:`AccoRefusal` (a ``ValueError``: ``except ValueError`` still catches it; ``refusal``: the
row's key, ``row``: the row) that reads ``found`` -- the setting as the adapter found it, with its value --
then the row's reason and fix. The config model's own errors on the ``"acco"`` block are rows too
(``acco_*``, raised by ``AccoConfig.from_block``). Warnings are rows of their own table
(:mod:`.warning_rows`: :class:`Row` records that are logged, never raised). What the caller passed is
checked by ``ds_acco.config_keys.check_deepspeed_compat`` (DeepSpeed's parsed config, every key
classified there), :func:`check_schedule_compat` and :func:`check_layout` (the layout asked for); what an
adapter built, once, by :func:`.built.check_built` (check point 2), whose checks of the parts live there.
Nothing here imports a framework: the adapters hand over plain values (sizes, dtypes, names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .layout import ParallelLayout  # noqa: F401 -- check_layout's argument; callers import it from here

SEE_FOUND = "{found}: {why}; fix: {fix}"


@dataclass(frozen=True)
class Row:
    """A setting, why it matters and the fix. ``why`` and ``fix`` may name fields (``{accumulation}``,
    ``{uneven_steps}``, ...) filled from the call; ``form`` joins the three parts (most rows read
    "found: why; fix: fix")."""

    key: str
    what: str
    why: str
    fix: str
    form: str = SEE_FOUND

    def message(self, found: str = "", **fields) -> str:
        fields.setdefault("uneven_steps", UNEVEN_STEPS.get(fields.get("accumulation", ""), ""))
        return _fill(self.form, found=found, why=_fill(self.why, **fields), fix=_fill(self.fix, **fields))


@dataclass(frozen=True)
class Refusal(Row):
    """One row of :data:`REFUSALS`. Layout rows have ``found_in(acco, layout)``: the setting they
    refuse under ``layout``, or a false value when they do not apply."""

    found_in: Optional[Callable[..., Optional[str]]] = None

    def refuse(self, found: str = "", **fields) -> "AccoRefusal":
        """The error to raise: the message, this row as ``error.row``, its key as ``error.refusal``."""
        return AccoRefusal(self.message(found, **fields), self)


class AccoRefusal(ValueError):
    """A setting ACCO refuses: its message names the setting, its value, why and the fix; ``row`` is
    the :class:`Refusal` of :data:`REFUSALS` it comes from, ``refusal`` that row's key."""

    def __init__(self, message: str, row: Refusal):
        super().__init__(message)
        self.row = row
        self.refusal = row.key

    def __reduce__(self):
        # Pickle / copy (a process pool, a launcher) rebuild it from the message and the row's key:
        # the row itself is not picklable (layout rows hold lambdas) and is the table's anyway.
        return _rebuilt, (type(self), str(self.args[0]), self.refusal)


def _rebuilt(cls, message: str, key: str) -> AccoRefusal:
    return cls(message, REFUSALS[key])


def _fill(text: str, **fields) -> str:
    # Not str.format: the texts quote JSON ({"stage": 1}), whose braces are not fields.
    for name, value in fields.items():
        text = text.replace("{" + name + "}", str(value))
    return text


# Why a caller that counts A micro-batches per rank per optimizer step (Megatron, HF Trainer /
# Accelerate) cannot follow each policy: the reasons its refusals give.
UNEVEN_STEPS = {
    "dynamic": "dynamic ACCO commits a step whenever a round finishes, with as many micro-batches as fitted "
               "under it (twice per iteration, or more), so its LR schedule and step counts would run ahead of "
               "its own",
    "shared": "shared ACCO keeps the global batch but gives each rank its own number of micro-batches per step "
              "(its share by measured speed), so every rank's count of A micro-batches per step drifts from the "
              "committed steps, differently on each rank, and the ranks stop evaluating and saving at the same "
              "points",
}
LOCKSTEP_WHY = ("it gives each rank its own number of micro-batches per phase, but every micro-batch runs collectives "
                "with the other ranks, which must all compute the same micro-batches")
LOCKSTEP_FIX = "set \"accumulation\": \"fixed\""


def _per_rank_phases(acco) -> bool:
    return acco.accumulation in ("dynamic", "shared")


_ROWS = (
    # -- the "acco" block itself (AccoConfig.from_block: the config model's own errors) ---------------
    Refusal("acco_not_object", "an \"acco\" block that is not a JSON object",
            "the block is read as an object of ACCO's keys", "write e.g. \"acco\": {\"enabled\": true}"),
    Refusal("acco_unknown_key", "a key the \"acco\" block (or one of its objects) does not have",
            "unknown key (a misspelt key would silently leave its setting at the default)",
            "remove it or use one of the keys the README's config reference lists"),
    Refusal("acco_invalid_value", "a value of the wrong type or out of range for its key",
            "the config model validates each key's type and range (strictly: no silent coercion)",
            "set a valid value or remove the key to get the default"),
    Refusal("acco_no_effect", "a key that has no effect with the other settings of the block",
            "it would be ignored (acco.dynamic without dynamic accumulation, sigterm_checkpoint_dir without "
            "sigterm 'checkpoint', estimate in mode 'dpu' / 'one_round', sync_warmup_steps in 'dpu' / 'auto', predictor "
            "without the one-round mode, auto_* keys without mode 'auto')",
            "remove the key, or set the setting it belongs to"),
    Refusal("acco_sigterm_checkpoint_dir", "acco.sigterm 'checkpoint' without acco.sigterm_checkpoint_dir",
            "a checkpoint on SIGTERM needs a directory to save to",
            "set it to a directory or use \"sigterm\": \"stop\""),
    Refusal("acco_sync_warmup_not_fixed", "acco.sync_warmup_steps with accumulation other than 'fixed'",
            "the synchronous warm-up runs stock's fixed schedule",
            "use \"accumulation\": \"fixed\" or remove sync_warmup_steps"),
    Refusal("acco_lr_warmup_unknown", "acco.sync_warmup_steps \"lr_warmup\" without a DeepSpeed warm-up scheduler",
            "\"lr_warmup\" reads warmup_num_steps from the config's \"scheduler\" block (WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR) where DeepSpeed runs it (no client lr_scheduler passed); a client or other scheduler's "
            "warm-up is not known to ACCO",
            "set sync_warmup_steps to the warm-up's number of optimizer steps"),
    Refusal("acco_dynamic_bounds", "acco.dynamic.max_micro_batches below min_micro_batches",
            "no phase length fits between them", "raise max_micro_batches or lower min_micro_batches"),
    # -- the schedule, every adapter ---------------------------------------------------------------
    Refusal("fp16_master_weights", "fp16.fp16_master_weights_and_grads",
            "ACCO keeps fp32 master shards and accumulates gradients in fp32",
            "remove fp16_master_weights_and_grads or disable acco"),
    Refusal("odd_accumulation", "an odd gradient_accumulation_steps in mode 'acco'",
            "acco.mode 'acco' splits each optimizer step into two equal halves (estimate, commit), so it needs an "
            "even value >= 2",
            "set gradient_accumulation_steps to {even} or use \"mode\": \"dpu\""),
    Refusal("fp16_estimate_round", "acco.estimate_comm_dtype 'fp16' with fp16 dynamic loss scaling",
            "the estimate round would sum loss-scaled gradients over the ranks in fp16, and its overflows are not "
            "fed to the scaler (only commits are, once per step), so estimates could fall back to θ unnoticed",
            "use 'bf16' for the estimate round (same bytes, fp32's range) or remove it"),
    Refusal("raise_on_overflow", "acco.nonfinite 'raise' with fp16 dynamic loss scaling",
            "overflows are how the dynamic scaler finds its scale (the step is skipped and the scale halved), so "
            "raising would stop the run at the first one",
            "set acco.nonfinite to 'skip', or a static fp16.loss_scale > 0"),
    Refusal("lockstep", "per-rank phase lengths where every micro-batch runs collectives",
            LOCKSTEP_WHY, LOCKSTEP_FIX),
    Refusal("estimate_variant_optimizer", "an estimate that reads Adam's committed second moment, without it",
            "reads the committed second moment of torch Adam / AdamW, which {optimizer} (with these settings) "
            "does not give",
            "use torch.optim.Adam/AdamW (DeepSpeed config: \"torch_adam\": true, no capturable or differentiable) or "
            "remove the key", form="{found} {why}; fix: {fix}"),
    Refusal("estimate_lr_scale_without_lr", "a learning-rate factor with a param group whose rate cannot be scaled",
            "scales a round's learning rate, and {optimizer}'s param group {group} has lr = {lr}, which cannot be "
            "scaled (it computes its own rate, e.g. Adafactor with relative_step=True, or an integer tensor)",
            "set {unscaled}, or give the optimizer a floating-point learning rate", form="{found} {why}; fix: {fix}"),
    Refusal("weight_unweighted", "a micro-batch weight= without acco.weighting 'sample' / 'token'",
            "every micro-batch weighs 1", "set acco.weighting to 'sample' or 'token', or drop weight"),
    Refusal("weighting_needs_weight", "acco.weighting 'sample' / 'token' without a micro-batch weight=",
            "the loss must be the sum over {weighting}s, not their mean",
            "pass {call}(loss, weight=n) with n the micro-batch's {weighting} count, or set acco.weighting to "
            "'micro_batch'", form="{found}; {why}; fix: {fix}"),
    Refusal("sigterm_main_thread", "acco.sigterm with an engine built off the main thread",
            "signal handlers", "set \"sigterm\": \"off\"", form="{found} ({why}); fix: {fix}"),
    Refusal("ranks_differ", "settings that differ between ranks (e.g. ACCO enabled on one rank only): they would "
            "issue different collectives and hang", "differs between ranks: {lines}", "give every rank the same config",
            form="{found} {why}; fix: {fix}"),
    Refusal("one_round_accumulation", "acco.mode 'one_round' with accumulation other than 'fixed'",
            "the one-round mode is built and checked for fixed phases only (one commit round per "
            "gradient_accumulation_steps micro-batches); its dynamic and shared phase ends are not implemented",
            "use \"accumulation\": \"fixed\" (or \"mode\": \"acco\")"),
    Refusal("auto_accumulation", "acco.mode 'auto' with accumulation other than 'fixed'",
            "mode 'auto' chooses between stock's step and the fixed schedules by the step-time rules of fixed phases",
            "use \"accumulation\": \"fixed\" (or name the mode, e.g. \"mode\": \"acco\")"),
    Refusal("one_round_predictor_optimizer", "acco.predictor 'nag' with an optimizer whose m, v it cannot read",
            "reads the committed first and second moments of torch Adam / AdamW, which {optimizer} (with these "
            "settings) does not give",
            "use torch.optim.Adam/AdamW (DeepSpeed config: \"torch_adam\": true) or the predictor 'ef' or 'ext'",
            form="{found} {why}; fix: {fix}"),
    Refusal("one_round_ext_room", "acco.predictor 'ext' where B has no room for θ_{t-1}",
            "keeps θ_{t-1} (fp32) in bytes of the communication buffer that the round no longer needs, and with "
            "{world} rank(s), gradients in {comm_dtype} and weights in {live_dtype} rank {rank} has none (2 ranks "
            "need fp32 gradients and weights)",
            "use the predictor 'ef' (one fp32 shard-sized buffer) or 'nag', or more ranks",
            form="{found}: {why}; fix: {fix}"),
    Refusal("one_round_fsdp", "AccoFSDP with acco.mode 'one_round'",
            "the one-round mode is implemented for DeepSpeed ZeRO-1's flat buffers only (FSDP2's rank-major "
            "layout and sharded_params gathering are not)",
            "use ds_acco.initialize (DeepSpeed ZeRO-1), or mode 'acco' / 'dpu' with AccoFSDP (mode 'auto': leave "
            "\"one_round\" out of auto_modes)"),
    Refusal("one_round_export", "an export outside a committed_weights() block in mode 'one_round'",
            "the model's replica holds the predicted point P, never θ; θ lives in the fp32 master shards and "
            "reaches the model only through an all-gather, a collective",
            "export inside `with ds_acco.committed_weights(engine):` entered on every rank at the same micro-batch "
            "count (e.g. `if rank == 0: torch.save(model.state_dict(), path)` inside it; engine.save_checkpoint "
            "does this itself), or after engine.destroy()"),
    # -- DeepSpeed's config and engine ---------------------------------------------------------------
    Refusal("fp16_autocast", "torch_autocast with fp16",
            "fp16 autocast makes DeepSpeed scale losses with a torch GradScaler that ACCO's rounds do not divide out",
            "set torch_autocast.dtype to \"bf16\", use the \"fp16\" block (DeepSpeed's loss scaler, supported), or "
            "disable acco"),
    Refusal("unmanaged_accumulation", "managed_gradient_accumulation = false",
            "the caller would run k backward() per step(), while ACCO ends a phase at every step() and counts "
            "gradient_accumulation_steps micro-batches per optimizer step itself",
            "remove it (or set true), set gradient_accumulation_steps to your k and call engine.step() after every "
            "engine.backward(), or disable acco"),
    Refusal("sum_not_fixed", "gradient_allreduce_op = \"sum\" with accumulation or weighting other than fixed / micro_batch",
            "stock sums each rank's mean over its own micro-batches; with uneven counts or weights there is no such "
            "sum to match (ACCO's rounds take one mean over every rank's micro-batches)",
            "drop gradient_allreduce_op (the mean), or use accumulation \"fixed\" and weighting \"micro_batch\""),
    Refusal("bf16_master_weights", "bf16.bf16_master_weights_and_grads",
            "ACCO keeps fp32 master shards and steps them with fp32 gradients",
            "remove bf16_master_weights_and_grads (and bf16_optimizer_states) or disable acco"),
    Refusal("deepcompile", "compile.deepcompile", "DeepCompile inserts its own gradient reduction passes, which "
            "ACCO's rounds replace", "remove compile.deepcompile or disable acco"),
    Refusal("dynamic_batching", "data_efficiency.data_sampling.dynamic_batching.enabled",
            "it sets each batch's size and learning rate on the optimizer per micro-batch, while ACCO's rounds "
            "step with the learning rate captured when each round was launched",
            "remove dynamic_batching (fixed micro-batches) or disable acco"),
    Refusal("zero_stage", "a ZeRO stage other than 1", "ACCO is a ZeRO stage 1 optimizer",
            "set \"zero_optimization\": {\"stage\": 1} or disable acco"),
    Refusal("optimizer_offload", "zero_optimization.offload_optimizer", "ACCO keeps the sharded optimizer on the "
            "accelerator", "remove offload_optimizer or disable acco"),
    Refusal("zenflow", "zero_optimization.zenflow", "ZenFlow replaces the ZeRO optimizer ACCO extends",
            "remove zenflow or disable acco"),
    Refusal("hybrid_engine", "hybrid_engine.enabled", "not supported with ACCO", "disable one of them"),
    Refusal("not_zero1_optimizer", "an engine whose optimizer is not DeepSpeed's ZeRO stage 1",
            "not a ZeRO stage 1 optimizer",
            "use \"zero_optimization\": {\"stage\": 1} with an optimizer (client or \"optimizer\" block), or disable "
            "acco", form="{found}, {why}; fix: {fix}"),
    Refusal("pipeline_module", "a PipelineModule", "DeepSpeed's pipeline engine is not supported by ACCO",
            "train without pipeline parallelism (Megatron-DeepSpeed builds a PipelineModule even with "
            "--pipeline-model-parallel-size 1 unless you pass --no-pipeline-parallel), or disable acco"),
    Refusal("unscaled_backward", "engine.backward(..., scale_wrt_gas=False)",
            "the mean gradient is formed from the 1/gradient_accumulation_steps loss scaling",
            "keep scale_wrt_gas=True (HF Trainer / Accelerate: call ds_acco.install() before building the Trainer)"),
    Refusal("estimate_dtype_deepspeed", "an estimate round wider than DeepSpeed's communication dtype",
            "is wider than the communication dtype {comm_dtype}",
            "use a narrower one (e.g. 'bf16'), or set DeepSpeed's communication_data_type / "
            "data_types.grad_accum_dtype to fp32", form="{found} {why}; fix: {fix}"),
    Refusal("per_rank_phases_accelerate", "dynamic / shared accumulation under Accelerate / HF Trainer",
            "the Trainer counts one optimizer step per gradient_accumulation_steps micro-batches on every rank "
            "(max_steps, save_steps, its LR schedule, checkpoint names) while {uneven_steps}",
            "use \"accumulation\": \"fixed\" with HF Trainer, or drive the engine yourself (engine.backward + "
            "engine.step per micro-batch, loop on engine.global_steps)"),
    # -- parallel layouts (check_layout, in this order) ------------------------------------------------
    Refusal(
        "pipeline_parallel", "pipeline parallelism",
        "ACCO runs on DeepSpeed's ZeRO-1 engine, not its pipeline engine, which schedules its own micro-batches "
        "and reduces per stage",
        "run with --pipeline-model-parallel-size 1 --no-pipeline-parallel (tensor parallelism is supported), or "
        "disable acco",
        found_in=lambda a, l: l.pipeline_parallel > 1 and (
            f"acco.enabled = true with pipeline parallelism: {l.pipeline_parallel_from} = {l.pipeline_parallel}")),
    Refusal(
        "ulysses", "sequence parallelism (DeepSpeed-Ulysses)",
        "ZeRO then reduces over the sequence-data-parallel group, which ACCO's rounds do not support yet",
        "--ds-sequence-parallel-size 1 (no sequence_parallel_size in the config, no sequence-parallel mesh; tensor "
        "parallelism is supported), or disable acco",
        found_in=lambda a, l: l.sequence_parallel > 1 and (
            f"acco.enabled = true with sequence parallelism: {l.sequence_parallel_from} = {l.sequence_parallel}")),
    Refusal(
        "megatron_sequence_parallel", "Megatron's sequence parallelism (--sequence-parallel)",
        "each tensor-parallel rank computes the gradients of those parameters (layer norms, row-parallel biases) "
        "on its own slice of the sequence, so they must be summed over the tensor-parallel group before the "
        "optimizer step; Megatron does that in its own optimizer (reduce_model_grads), which its train_step skips "
        "under --deepspeed, and neither DeepSpeed's ZeRO nor ACCO does it, so the tensor-parallel copies of those "
        "parameters would drift apart",
        "run without --sequence-parallel (tensor parallelism alone is supported), or disable acco",
        found_in=lambda a, l: l.tensor_parallel > 1 and l.sequence_parallel_params and (
            f"acco.enabled = true with Megatron's sequence parallelism: {len(l.sequence_parallel_params)} parameters "
            f"marked sequence_parallel = True (e.g. {l.sequence_parallel_params[0]!r}) under tensor parallelism "
            f"({l.tensor_parallel_from} = {l.tensor_parallel})")),
    Refusal(
        "moe_experts", "MoE experts", "ACCO does not partition expert groups",
        "train the MoE model with stock ZeRO (disable acco)",
        found_in=lambda a, l: bool(l.expert_params) and (
            f"acco.enabled = true with MoE expert parameters ({len(l.expert_params)}, e.g. {l.expert_params[0]!r}: "
            "param.allreduce = False)")),
    Refusal(
        "per_rank_phases_tensor_parallel", "per-rank phase lengths under tensor parallelism",
        LOCKSTEP_WHY, LOCKSTEP_FIX,
        found_in=lambda a, l: _per_rank_phases(a) and l.tensor_parallel > 1 and (
            f"acco.accumulation = {a.accumulation!r} with tensor parallelism "
            f"({l.tensor_parallel_from} = {l.tensor_parallel}: every forward and backward runs collectives over "
            "the tensor-parallel group)")),
    Refusal(
        "per_rank_phases_caller_boundary", "per-rank phase lengths with a caller that sets the accumulation boundary",
        "the caller counts one optimizer step, one lr_kwargs increment and one global batch per iteration of A "
        "micro-batches on every rank, while {uneven_steps}",
        "use \"accumulation\": \"fixed\" (the same batches and steps as stock), or drive the engine with "
        "engine.backward + engine.step per micro-batch and loop on engine.global_steps",
        found_in=lambda a, l: _per_rank_phases(a) and l.caller_sets_boundary and (
            f"acco.accumulation = {a.accumulation!r} with a caller that sets the accumulation boundary and calls "
            "step() once per iteration (Megatron-DeepSpeed's train_step)")),
    Refusal(
        "one_round_tensor_parallel", "acco.mode 'one_round' with tensor parallelism",
        "the one-round mode is built and checked on data-parallel ZeRO-1 only (its predictors and the gather of θ "
        "for evaluations are not tested over model-parallel groups)",
        "train without tensor parallelism, or use mode 'acco' / 'dpu'",
        found_in=lambda a, l: "one_round" in a.schedule_modes() and l.tensor_parallel > 1 and (
            f"acco.mode = 'one_round' with tensor parallelism ({l.tensor_parallel_from} = {l.tensor_parallel})")),
    # -- FSDP2 (AccoFSDP) ----------------------------------------------------------------------------------
    Refusal("fsdp_disabled", "AccoFSDP with acco.enabled = false", "AccoFSDP always runs ACCO/DPU",
            "set \"acco\": {\"enabled\": true, ...}, or train the FSDP model with its own loop for the stock baseline"),
    Refusal("fsdp_mesh", "HSDP, 2-D meshes, or several meshes",
            "AccoFSDP supports one 1-D device mesh for every fully_shard call (plain FSDP, not HSDP or 2-D meshes)",
            "pass the same 1-D mesh to every fully_shard (of a 2-D mesh, its data-parallel dimension: mesh[\"dp\"])",
            form="{why}; fix: {fix}"),
    Refusal("fsdp_placement", "a shard placement other than dim 0, or DTensor module parameters",
            "AccoFSDP shards parameters on dim 0 only, with plain (non-DTensor) module parameters",
            "drop shard_placement_fn / tensor parallelism", form="{why}; fix: {fix}"),
    Refusal("fsdp_cpu_offload", "FSDP's CPUOffloadPolicy", "CPUOffloadPolicy is not supported by AccoFSDP",
            "remove offload_policy", form="{why}; fix: {fix}"),
    Refusal("fsdp_mixed_precision", "several MixedPrecisionPolicies in one model",
            "AccoFSDP needs one MixedPrecisionPolicy (param_dtype / reduce_dtype) for the whole model",
            "pass the same mp_policy to every fully_shard", form="{why}; fix: {fix}"),
    Refusal("fsdp_fp16_dtypes", "loss scaling without fp16 compute and fp32 gradients",
            "loss scaling is for fp16 compute with fp32 gradients",
            "fully_shard with MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32), or "
            "remove the fp16 block"),
    Refusal("fsdp_fp16_unscaled", "fp16 compute without loss scaling", "small gradients would underflow",
            "add \"fp16\": {\"enabled\": true} (dynamic loss scaling) to the config, or use bf16"),
    Refusal("estimate_dtype_fsdp", "an estimate round wider than the MixedPrecisionPolicy's reduce dtype",
            "is wider than the communication dtype {comm_dtype} (the MixedPrecisionPolicy's reduce_dtype, else "
            "param_dtype)", "use a narrower one (e.g. 'bf16') or remove it", form="{found} {why}; fix: {fix}"),
    Refusal("fsdp_post_forward_mesh", "sharded_params with an integer reshard_after_forward", "not supported",
            "fully_shard with reshard_after_forward=True (or False)"),
    Refusal("fsdp_batch_size", "train_batch_size / train_micro_batch_size_per_gpu that DeepSpeed would not run",
            "DeepSpeed reads train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x the "
            "data-parallel size, with a whole number >= 1 of samples per micro-batch (AccoFSDP counts "
            "global_samples by it)",
            "set train_micro_batch_size_per_gpu to an integer >= 1 and train_batch_size to that product (or remove "
            "train_batch_size)"),
    Refusal("fsdp_sharded_params_optimizer", "sharded_params with an optimizer that has no functional step",
            "its estimate would take a real step on the shards FSDP all-gathers from during that phase (only torch "
            "SGD / Adam / AdamW have a functional step)",
            "use one of those, or the resident layout (sharded_params=False)"),
)
REFUSALS: Dict[str, Refusal] = {r.key: r for r in _ROWS}
LAYOUT_REFUSALS = tuple(r for r in _ROWS if r.found_in is not None)
assert len(REFUSALS) == len(_ROWS), "refusal keys must be unique"


def refuse(key: str, found: str = "", **fields) -> AccoRefusal:
    """The error of row ``key`` (for the caller to raise; ``error.refusal == key``)."""
    return REFUSALS[key].refuse(found, **fields)


# -- the checks ----------------------------------------------------------------------------------------------
def check_schedule_compat(acco, gradient_accumulation_steps: int, fp16=None) -> None:
    """Checks every adapter shares: the accumulation count fits the mode; under fp16 (``fp16``:
    DeepSpeed's parsed ``DeepSpeedFP16Config``, or None) fp32 master shards and gradients, and
    overflows skipped (not raised) with dynamic loss scaling."""
    gas = gradient_accumulation_steps
    fp16 = fp16 if fp16 is not None and fp16.enabled else None
    fp16_dynamic_loss_scale = fp16 is not None and fp16.loss_scale == 0
    if fp16 is not None and getattr(fp16, "fp16_master_weights_and_grads", False):
        raise refuse("fp16_master_weights", "fp16.fp16_master_weights_and_grads = true")
    if "acco" in acco.schedule_modes() and (gas < 2 or gas % 2):
        raise refuse("odd_accumulation", f"gradient_accumulation_steps = {gas}", even=max(2, gas + gas % 2))
    if fp16_dynamic_loss_scale and acco.estimate_comm_dtype == "fp16":
        raise refuse("fp16_estimate_round", "acco.estimate_comm_dtype = 'fp16' with fp16 dynamic loss scaling")
    if fp16_dynamic_loss_scale and acco.nonfinite == "raise":
        raise refuse("raise_on_overflow",
                     "acco.nonfinite = 'raise' with fp16 dynamic loss scaling (fp16.loss_scale = 0)")


def check_lockstep(acco, collective: str) -> None:
    """Refuses per-rank phase lengths ('dynamic', 'shared') where every micro-batch's forward or
    backward runs collectives with other ranks (``collective`` says which): those pair by issue
    order, so a rank that computes one micro-batch more than its peers would pair its collectives
    with theirs of another phase (a hang, or weights gathered from different phases' sources)."""
    if _per_rank_phases(acco):
        raise refuse("lockstep", f"acco.accumulation = {acco.accumulation!r} with {collective}")


def check_layout(acco, layout: ParallelLayout) -> None:
    """Raise the first :data:`LAYOUT_REFUSALS` row that applies to an enabled ``acco`` under
    ``layout`` (a ``ValueError`` with the setting found, the reason and the fix)."""
    if not acco.enabled:
        return
    for row in LAYOUT_REFUSALS:
        found = row.found_in(acco, layout)
        if found:
            raise row.refuse(found, accumulation=acco.accumulation)


def under_caller_boundary(accumulation: str) -> AccoRefusal:
    """The error of ``accumulation`` (dynamic / shared) for a Megatron-style caller."""
    return refuse("per_rank_phases_caller_boundary",
                  f"acco.accumulation = {accumulation!r} with a caller that sets the accumulation boundary and calls "
                  "step() once per iteration (Megatron-DeepSpeed's train_step)", accumulation=accumulation)


def under_accelerate(accumulation: str) -> AccoRefusal:
    """The error of ``accumulation`` (dynamic / shared) under Accelerate / HF Trainer."""
    return refuse("per_rank_phases_accelerate",
                  f"acco.accumulation = {accumulation!r} under Accelerate / HF Trainer", accumulation=accumulation)
