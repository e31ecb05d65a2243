"""The math app's input checks, run before any rank starts (by `rlinf-hpc run`, then by rank
0): components, model directory, data files, prompts against the tokenizer, vLLM install and
placement, the warm-start cache. Imports no torch (a model directory's tokenizer loads
through transformers, without its weights)."""

from __future__ import annotations

from pathlib import Path

from rlinf_hpc.apps.math.tasks import ArithmeticTask, JsonlTask, make_task, vocabulary_texts
from rlinf_hpc.apps.math.tasks.prompts import PromptFormat
from rlinf_hpc.apps.math.tasks.teacher import check_teacher
from rlinf_hpc.config import Config
from rlinf_hpc.config.apps import require_components
from rlinf_hpc.engines.host import check_torch_companions, warn_if_bf16_is_slow
from rlinf_hpc.engines.memory import TrainingMemory, estimate_training_memory, safetensors_parameters
from rlinf_hpc.engines.model import check_model_dir, check_tokenizer_fits, load_tokenizer, text_config
from rlinf_hpc.engines.tokenizer import CharTokenizer, Tokenizer
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.metrics import require_tensorboard
from rlinf_hpc.runtime.oomkill import cgroup_state
from rlinf_hpc.runtime.rundir import make_writable_dir

log = get_logger("grpo")

COMPONENTS = ("rollout", "reward", "inference", "actor")
DTYPE_BYTES_OF = {"float32": 4, "bfloat16": 2, "float16": 2}
CRITIC_WORKER = "rlinf_hpc.apps.math.critic:CriticWorker"


def validate(config: Config) -> None:
    """Before any worker starts: the components, the model directory, the data files."""
    require_components(config, COMPONENTS, "math_grpo")
    check_torch_companions()
    on_cpu = [n for n in ("rollout", "inference", "actor", "critic") if n in config.components]
    warn_if_bf16_is_slow(config.model.dtype, [n for n in on_cpu if config.components[n].device == "cpu"])
    ppo = config.grpo.algorithm == "ppo"
    if ppo and "critic" not in config.components:
        raise UserError(
            'grpo.algorithm = "ppo" needs a critic: add [components.critic] with worker = '
            f'"{CRITIC_WORKER}" (its own ranks, or the actor\'s with placement.mode = '
            '"collocated"), or use grpo.algorithm = "grpo", which needs none.'
        )
    if not ppo and "critic" in config.components:
        raise UserError(
            f'the config has [components.critic] but grpo.algorithm = "{config.grpo.algorithm}" '
            'has no critic: its ranks would idle. Remove the table or set grpo.algorithm = "ppo".'
        )
    if config.model.path:
        check_model_dir(config.model.path)
        check_actor_fits(config, host_memory_bytes())
    if config.grpo.rollout_backend == "vllm":
        from rlinf_hpc.engines.vllm_engine import check_vllm_install

        wanted = config.components["rollout"].device
        if wanted == "any":  # the rank's own device; rank 0's stands in for it here
            import torch

            wanted = "gpu" if torch.cuda.is_available() else "cpu"
        check_vllm_install("cpu" if wanted == "cpu" else "cuda")
        check_vllm_placement(config)
    if config.grpo.tensorboard:
        require_tensorboard()
    task = make_task(config.task, config.job.seed)  # reads and checks the data files
    check_prompts(config, task)
    check_teacher(config.sft, config.task)
    check_cache_dir(config.sft.cache_dir)


def host_memory_bytes() -> int | None:
    """Memory this host's ranks may use: the node's, or its memory cgroup's limit if lower."""
    state = cgroup_state()
    limits = [state.get("node_total_mb"), state.get("cgroup_limit_mb")]
    known = [mb for mb in limits if mb]
    return int(min(known) * 2**20) if known else None


def actor_memory(config: Config) -> TrainingMemory:
    """One actor rank's estimate for the model directory in ``model.path`` (see
    `rlinf_hpc.engines.memory`)."""
    grpo, actor = config.grpo, config.components["actor"]
    shape = text_config(config.model.path)
    tokens = grpo.micro_batch_tokens or (
        grpo.prompts_per_step * grpo.group_size // max(actor.num_ranks * grpo.minibatches, 1)
    ) * (config.task.max_prompt_length + grpo.max_response_length)
    sharded = grpo.train_backend == "deepspeed"
    return estimate_training_memory(
        safetensors_parameters(config.model.path), shape["hidden_size"], shape["intermediate_size"],
        shape["vocab_size"], shape["num_hidden_layers"], DTYPE_BYTES_OF[config.model.dtype], tokens,
        config.model.gradient_checkpointing, actor.num_ranks if sharded else 1,
        actor.num_ranks if sharded and grpo.zero_stage == 2 else 1,
    )  # fmt: skip


def check_actor_fits(config: Config, host_bytes: int | None) -> None:
    """`UserError` when one CPU actor rank's estimate (parameters, gradients, AdamW state,
    activations at the token budget) exceeds this host's memory, before anything loads."""
    if config.components["actor"].device != "cpu" or host_bytes is None:
        return  # a GPU's memory is known on its rank only; the rank's OOM is reported there
    need = actor_memory(config)
    if need.total <= host_bytes:
        return
    raise UserError(
        f"the actor cannot fit: training {config.model.path} in {config.model.dtype} needs about "
        f"{need.describe()} on one actor rank, and this host has {host_bytes / 2**30:.1f} GiB. "
        "To fit: lower grpo.micro_batch_tokens (activations), set model.gradient_checkpointing = "
        'true, shard the optimizer with grpo.train_backend = "deepspeed" over more '
        "components.actor.num_ranks (zero_stage = 2 shards gradients too), or use a host with "
        "more memory."
    )


def check_prompts(config: Config, task: ArithmeticTask | JsonlTask) -> None:
    """Every prompt (training and held-out) renders with the job's tokenizer and fits
    ``task.max_prompt_length`` when ``task.truncation = "error"``; the tokenizer fits the
    model's embedding. Loads the tokenizer only (not the weights)."""
    prompts = PromptFormat.of_task(config.task)  # a template without {question}: UserError
    tokenizer: Tokenizer
    if config.model.path:
        tokenizer = load_tokenizer(config.model.path)
        check_tokenizer_fits(config.model.path, tokenizer)
    else:
        tokenizer = CharTokenizer.for_texts(vocabulary_texts(config.task, task))
    problems = task.eval_problems() + (task.train_problems() if isinstance(task, JsonlTask) else [])
    prompts.uses_chat(tokenizer)  # "always" without a chat template: UserError
    if config.task.truncation == "error":
        for start in range(0, len(problems), 512):  # stops at the first batch with a long one
            prompts.encode([p.prompt for p in problems[start : start + 512]], tokenizer)


def check_vllm_placement(config: Config) -> None:
    """An in-process vLLM engine starts a torch.distributed group of its own: it cannot share a
    rank with a data-parallel (multi-rank) actor or critic, which needs one of its size."""
    placement = config.placement
    if placement.mode == "collocated":
        together = [set(config.components)]
    elif placement.mode == "hybrid":
        together = [set(group) for group in placement.groups]
    else:
        return
    for group in together:
        if "rollout" not in group:
            continue
        parallel = [n for n in ("actor", "critic") if n in group and config.components[n].num_ranks > 1]
        if parallel:
            raise UserError(
                f'grpo.rollout_backend = "vllm" with placement.mode = "{placement.mode}" puts the '
                f"rollout on the ranks of the data-parallel {', '.join(parallel)} "
                f"({config.components[parallel[0]].num_ranks} ranks). The in-process vLLM engine "
                "starts a torch.distributed group of its own, DDP/DeepSpeed need one over their "
                "ranks, and a process has one. Give the rollout its own ranks (a hybrid group "
                'without the actor, or "disaggregated"), or use rollout_backend = "hf".'
            )


def check_cache_dir(cache_dir: str) -> None:
    """Warn up front (not after training) when the warm-start cache cannot be written."""
    if not cache_dir:
        return
    try:
        make_writable_dir(Path(cache_dir).expanduser())
    except OSError as exc:
        log.warning(
            "sft.cache_dir '%s' cannot be written (%s): the warm start will be trained but not "
            "cached (set sft.cache_dir to a writable directory, or to \"\" to turn caching off)",
            cache_dir, exc.strerror or exc,
        )  # fmt: skip
