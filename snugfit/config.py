"""Run configuration: defaults < TOML file < command-line overrides, validated with one-line errors.

Sections and keys are the fields of the dataclasses below; `snugfit train --help`
lists them all. A key is written `--section.key value`, or `--key value` when
the key name is unique across sections, on `snugfit train` and `snugfit plan`
alike (snugfit/commands/options.py): a new field is a new option of both.
"""

from __future__ import annotations

import difflib
import importlib.util
import types
import typing
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields

from snugfit.errors import SnugfitError
from snugfit.model.config import ModelConfig
from snugfit.model.hub import local_model
from snugfit.plan.dtype import canonical_dtype
from snugfit.plan.options import Constraints
from snugfit.plan.plan import MASTER_WEIGHTS, OPTIMIZER_STATES, OptimizerPlan
from snugfit.plan.policies import ALIASES, POLICY_NAMES
from snugfit.plan.rules import problem
from snugfit.plan.schedules import SCHEDULE_NAMES
from snugfit.plan.shape import GRAD_REDUCE

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


EXAMPLE_FORMATS = ("instruct", "chat")  # data of separate examples, padded or packed to seq_len


@dataclass
class DataConfig:
    path: str = ""  # file or folder; empty: the embedded corpus (Python's standard library source)
    format: str = "auto"  # auto | text | jsonl | bin | instruct (prompt/response pairs) | chat (messages)
    tokenizer: str = "byte"  # 'byte' or a local tokenizer.json (or its folder)
    text_field: str = "text"  # field of each .jsonl line
    prompt_field: str = "prompt"  # instruct: the loss is masked on the prompt
    response_field: str = "response"
    messages_field: str = "messages"  # chat: [{"role", "content"}, ...], rendered with the model's chat template
    bin_dtype: str = "uint16"  # uint16 | uint32, for pre-tokenized .bin files
    val_fraction: float = 0.05  # the last part of the stream held out for validation
    # instruct and chat examples packed into full sequences, boundaries kept (data.packing); unset: on for them
    # (padded, short examples waste most of a step), never for text streams (documents already run contiguous)
    pack: bool | None = None

    @property
    def packs(self) -> bool:
        """Whether the run packs its examples (data.pack, or its default for the format)."""
        return self.pack if self.pack is not None else self.format in EXAMPLE_FORMATS


def packed_in(saved: dict) -> bool:
    """Whether the run whose `RunConfig.to_dict()` this is packed its examples (runs from before packing did not)."""
    data = saved.get("data", {})
    return "pack" in data and DataConfig(format=data.get("format", "auto"), pack=data["pack"]).packs


@dataclass
class TrainConfig:
    steps: int = 300
    seq_len: int = 128
    batch_size: int = 16  # global batch, in sequences
    micro_batch_size: int = 0  # 0: the whole per-rank batch at once (no accumulation)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm (per unit's share of it when stepping in backward); 0 disables
    # How weights are stored and updated (plan.OptimizerPlan; each changes the numerics, so only you choose them):
    master_weights: str = "fp32"  # fp32 | bf16: bf16 weights updated with stochastic rounding, no fp32 copy
    optimizer_states: str = "fp32"  # fp32 | bf16 | 8bit | 4bit (torchao's blockwise quantized AdamW states)
    optimizer_in_backward: bool = False  # each unit steps as soon as its gradient is reduced; clipped per unit
    max_bad_steps: int = 5  # non-finite loss or gradient this many steps in a row stops the run
    dtype: str = "auto"  # auto: bf16 on GPUs with it, else fp16 (loss scaling), fp32 on CPU | float32 | bfloat16 | float16
    # compile each block (torch.compile): faster steps after a slower first one (README). unset: the search weighs it
    # on GPUs (taken where the run's steps repay the compilation); CPU ranks run eager unless it is set
    compile: bool | None = None
    seed: int = 0
    eval_every: int = 100  # steps between validation losses; 0: only at start and end
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 2
    out_dir: str = "runs/default"
    resume: bool = False  # continue from the newest checkpoint in out_dir
    trace_step: int = 0  # > 0: time this step's actions on every rank and draw them beside the plan's prediction
    # Calibration from the run: after replan_after steps of a launch, trace a step on every rank, correct the time
    # model's terms by what it measured (stored beside the hardware profile for later plans) and re-plan:
    replan: str = "report"  # off | report: record the plan the corrected model prefers, and its predicted gain |
    # switch: and go on under it (checkpointed at that step) when its predicted gain reaches replan_gain
    replan_after: int = 20  # warm-up steps before the calibration step
    replan_gain: float = 0.10
    progress: bool = True  # progress bar on rank 0
    plot: bool = True  # loss-curve PNG at the end
    tensorboard: bool = False  # also write TensorBoard event files to out_dir/tensorboard (extra: tensorboard)
    save_on_signal: bool = True  # SIGTERM / SIGINT / SIGUSR1: finish the step, checkpoint it, exit 128 + signal
    async_checkpoint: bool = True  # interval checkpoints written in the background; the step waits for the copy


@dataclass
class FinetuneConfig:
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank, freeze everything else
    lora_alpha: float = 0.0  # adapter scale alpha / rank; 0: alpha = rank
    lora_dropout: float = 0.0
    lora_targets: str = ""  # comma-separated layer names inside a block, or all-linear; empty: attention projections
    freeze: str = ""  # pieces to freeze: embed, norm, head, blocks, blocks:A-B (comma-separated)
    quantize_base: str = "none"  # none | nf4: frozen block linears stored in 4 bits (QLoRA; extra: qlora)


@dataclass
class ParallelConfig(Constraints):
    """The [parallel] section: the fixed parts of the plan `auto` searches (plan.options.Constraints: dp, tp, pp,
    schedule, virtual_stages, num_microbatches, zero, recompute, offload_optimizer, offload_params, evict_bound,
    grad_reduce; unset: searched, as `snugfit plan` takes them; train.micro_batch_size fixes the micro-batch), and
    how the ranks launch."""

    nproc: int = 1  # local ranks to start (through torchrun's launcher)
    plan: str = "auto"  # "auto": search the fastest plan that fits; a plan JSON to run as is; "dp": data parallel
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # host:port of node 0, for multi-node runs
    max_restarts: int = 0  # torchrun elastic restarts after a rank fails; the run resumes from its last checkpoint
    timeout_s: float = 300.0  # a collective or transfer that waits longer fails the step


DEFAULT_MODEL = {"dim": 192, "n_layers": 4, "n_heads": 6, "max_seq_len": 128}  # ~1.9M parameters


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        d = asdict(self)
        for sec, body in d.items():
            for name in [f.name for f in fields(getattr(self, sec)) if not f.metadata.get("config", True)]:
                del body[name]
        return d


SECTIONS = {f.name: f.type for f in fields(RunConfig)}
CHOICES = {
    "data.format": ("auto", "text", "jsonl", "bin", "instruct", "chat"),
    "data.bin_dtype": ("uint16", "uint32"),
    "train.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.arch": ("llama", "gpt2"),
    "model.attention": ("sdpa", "eager"),
    "finetune.quantize_base": ("none", "nf4"),
    "parallel.grad_reduce": GRAD_REDUCE,  # or unset: searched
    "parallel.schedule": SCHEDULE_NAMES,
    "parallel.recompute": (*POLICY_NAMES, *ALIASES),
    "train.master_weights": MASTER_WEIGHTS,
    "train.optimizer_states": OPTIMIZER_STATES,
    "train.replan": ("off", "report", "switch"),
}
OPTIM_EXTRA = 'pip install -e ".[optim]"'  # torchao, for bf16 weights and bf16, 8- and 4-bit states
POSITIVE = {"train.steps", "train.seq_len", "train.batch_size", "train.log_every", "train.eval_batches",
            "train.keep_checkpoints", "train.max_bad_steps", "parallel.nproc", "parallel.nnodes",
            "model.norm_eps", "model.rope_theta", "parallel.timeout_s",
            # fixed parts of a plan (None: searched)
            "parallel.dp", "parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.num_microbatches",
            "parallel.evict_bound", "parallel.cp", "parallel.ep", "parallel.mlp_tiles"}
NON_NEGATIVE = {"train.micro_batch_size", "train.warmup_steps", "train.eval_every", "train.checkpoint_every",
                "train.grad_clip", "train.weight_decay", "train.trace_step", "train.replan_after", "train.replan_gain",
                "parallel.node_rank", "parallel.max_restarts",
                "finetune.lora_rank", "finetune.lora_alpha", "finetune.lora_dropout",
                "model.n_experts", "model.n_shared_experts", "model.router_aux_coef"}
# Keys with an upper bound too: (lowest, highest, whether the highest is allowed)
BOUNDED = {"train.min_lr_ratio": (0.0, 1.0, True), "finetune.lora_dropout": (0.0, 1.0, False),
           "parallel.zero": (0, 3, True)}


def section_classes() -> dict[str, type]:
    return {f.name: type(getattr(RunConfig(), f.name)) for f in fields(RunConfig)}


def all_keys() -> dict[str, tuple[str, type]]:
    """'section.key' -> (section, python type) for every configurable key."""
    out = {}
    for sec, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata.get("config", True):  # not a config key: set from another (Constraints.micro_batch)
                out[f"{sec}.{f.name}"] = (sec, hints[f.name])
    return out


def _base_type(tp) -> type:
    """int | None -> int, so optional keys coerce like their type."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def coerce(key: str, value, tp) -> object:
    """Turn a TOML value or command-line string into the key's type, or raise a one-line error."""
    base = _base_type(tp)
    if value is None or (isinstance(value, str) and value.lower() == "none" and base is not str):
        if base is not tp:
            return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except ValueError:
        pass
    raise SnugfitError(f"{key} must be {_describe(base)}, got {value!r}")


def _describe(tp: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def resolve_key(name: str) -> str:
    """'steps' or 'train.steps' -> 'train.steps'; unknown keys get close matches."""
    keys = all_keys()
    if name in keys:
        return name
    short = [k for k in keys if k.split(".", 1)[1] == name]
    if len(short) == 1:
        return short[0]
    if len(short) > 1:
        raise SnugfitError(f"key {name!r} is ambiguous: write one of {', '.join(short)}")
    close = difflib.get_close_matches(name, list(keys) + [k.split(".", 1)[1] for k in keys], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `snugfit train --help` for all keys"
    raise SnugfitError(f"unknown config key {name!r}{hint}")


def load_toml(path: str) -> dict[str, object]:
    """A TOML file as {'section.key': value}."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise SnugfitError(f"config file {path!r} not found; pass an existing TOML file to --config") from None
    except tomllib.TOMLDecodeError as e:
        raise SnugfitError(f"config file {path} is not valid TOML: {e}; fix the file") from None
    flat = {}
    for sec, body in doc.items():
        if sec not in SECTIONS:
            close = difflib.get_close_matches(sec, list(SECTIONS), n=1)
            hint = f"; did you mean [{close[0]}]?" if close else f"; sections are {', '.join(SECTIONS)}"
            raise SnugfitError(f"{path}: unknown section [{sec}]{hint}")
        if not isinstance(body, dict):
            raise SnugfitError(f"{path}: {sec} must be a [section] table, got {body!r}")
        for key, value in body.items():
            flat[resolve_key(f"{sec}.{key}")] = value
    return flat


def build_config(file: str | None = None, overrides: dict[str, object] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then overrides ({'key' or 'section.key': value}); validated."""
    values = load_toml(file) if file else {}
    for name, value in (overrides or {}).items():
        values[resolve_key(name)] = value
    cfg = RunConfig()
    keys = all_keys()
    model_fields = dict(DEFAULT_MODEL)
    for key, value in values.items():
        sec, tp = keys[key]
        name = key.split(".", 1)[1]
        value = canonical_dtype(value) if key == "train.dtype" else value
        if sec == "model":
            model_fields[name] = coerce(key, value, tp)
        else:
            setattr(getattr(cfg, sec), name, coerce(key, value, tp))
    cfg.model = ModelConfig(**model_fields)  # derived fields (ffn_dim, n_kv_heads) follow the given ones
    cfg.model.name = local_model(cfg.model.name)  # a hub id: its folder in the local Hugging Face cache
    validate(cfg)
    return cfg


def config_from_dict(d: dict) -> RunConfig:
    """A RunConfig from its to_dict() form (as saved with every checkpoint)."""
    return build_config(None, {f"{sec}.{key}": value for sec, body in d.items() for key, value in body.items()})


def validate(cfg: RunConfig) -> None:
    for key, (sec, _) in all_keys().items():
        value = getattr(getattr(cfg, sec), key.split(".", 1)[1])
        if key in CHOICES and value is not None and value not in CHOICES[key]:
            raise SnugfitError(f"{key} must be one of {', '.join(CHOICES[key])}, got {value!r}")
        if value is None:
            continue
        if key in POSITIVE and value <= 0:
            raise SnugfitError(f"{key} must be positive, got {value}")
        if key in NON_NEGATIVE and value < 0:
            raise SnugfitError(f"{key} must be zero or positive, got {value}")
        if key in BOUNDED:
            low, high, closed = BOUNDED[key]
            if not low <= value <= high or (value == high and not closed):
                raise SnugfitError(f"{key} must be in [{low}, {high}{']' if closed else ')'}, got {value}")
    try:
        cfg.model.validate()
    except ValueError as e:
        raise SnugfitError(f"{e}; fix the [model] section") from None
    t = cfg.train
    if not 0 <= cfg.data.val_fraction < 1:
        raise SnugfitError(f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}")
    if t.lr <= 0:
        raise SnugfitError(f"train.lr must be positive, got {t.lr}")
    if t.seq_len > cfg.model.max_seq_len and not cfg.model.name:  # a named model has its own maximum
        raise SnugfitError(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len}); lower one or raise the other"
        )
    blocked = next((d for d in (Path(t.out_dir), *Path(t.out_dir).parents) if d.exists() and not d.is_dir()), None)
    if blocked is not None:
        raise SnugfitError(f"train.out_dir {t.out_dir!r}: {blocked} is a file, not a folder; name a folder "
                           "(--out-dir runs/NAME)")
    check_relations(cfg)
    if t.micro_batch_size and t.batch_size % t.micro_batch_size:
        raise SnugfitError(
            f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size ({t.micro_batch_size})"
        )
    check_optimizer(cfg)


def check_relations(cfg: RunConfig) -> None:
    """Options that each make sense alone but contradict each other: one line naming both and the fix."""
    f, par, t = cfg.finetune, cfg.parallel, cfg.train
    if not f.lora_rank:
        given = [k for k, v in (("lora_targets", f.lora_targets), ("lora_alpha", f.lora_alpha),
                                ("lora_dropout", f.lora_dropout)) if v]
        if given:
            raise SnugfitError(f"finetune.{given[0]} is set but finetune.lora_rank is 0 (no adapters); set "
                               "--lora-rank or drop it")
    if f.quantize_base == "nf4" and not (f.lora_rank or f.freeze):
        raise SnugfitError("finetune.quantize_base = 'nf4' stores frozen weights in 4 bits, but nothing is frozen; "
                           "add --lora-rank (QLoRA) or --freeze, or drop --quantize-base")
    if par.node_rank >= par.nnodes:
        raise SnugfitError(f"parallel.node_rank {par.node_rank} must be below parallel.nnodes ({par.nnodes})")
    if cfg.data.pack and cfg.data.format not in EXAMPLE_FORMATS:
        raise SnugfitError(f"data.pack packs instruct and chat examples; data.format {cfg.data.format!r} is a "
                           "token stream whose documents already run contiguous: drop --pack")
    if t.trace_step > t.steps:
        raise SnugfitError(f"train.trace_step {t.trace_step} is past train.steps ({t.steps}); it would never be "
                           "traced")


def optimizer_plan(t: TrainConfig) -> OptimizerPlan:
    """The run's optimizer setup, as plans carry it."""
    return OptimizerPlan(master_weights=t.master_weights, states=t.optimizer_states,
                         in_backward=t.optimizer_in_backward)


def check_optimizer(cfg: RunConfig) -> None:
    """Refuse, before any rank starts, an optimizer setup that cannot run: torchao missing, or the step in backward
    beside what a rule (plan.rules) says needs the whole gradient first (float16's overflow check, a step-wide
    reduction of several microbatches)."""
    t, opt = cfg.train, optimizer_plan(cfg.train)
    if opt.needs_torchao and importlib.util.find_spec("torchao") is None:
        what = (f"train.optimizer_states = {t.optimizer_states!r}" if t.optimizer_states != "fp32"
                else f"train.master_weights = {t.master_weights!r}")
        raise SnugfitError(f"{what} needs torchao: {OPTIM_EXTRA}")
    if not opt.in_backward:
        return
    ranks, micro = cfg.parallel.nproc * cfg.parallel.nnodes, t.micro_batch_size
    # the microbatches a step takes at the most data parallelism the launch allows (unknown while searched)
    m = -(-t.batch_size // (micro * ranks)) if micro else None
    broken = problem(cfg.parallel.parts(in_backward=True, compute_dtype=None if t.dtype == "auto" else t.dtype,
                                        num_microbatches=m))
    if broken:
        raise SnugfitError(f"train.optimizer_in_backward: {broken}")
