"""The model a run trains: loaded from a local folder with weights, or built from a config
with fresh weights. What `--model` names is resolved by memkit.spec.resolve (the same resolver
every command uses: a folder or config.json, a catalog name or alias, a cached hub id).

Then the plan's model-side knobs: attention kernel, activation checkpointing, LoRA.
Nothing is downloaded. The model's head follows the task (data_task): a causal LM, an encoder-
decoder's seq2seq LM, or a sequence / token classification head of --num-labels outputs; the
forward and loss sum of the task rows are task_loss_sum's.
"""
from __future__ import annotations


from memkit.errors import MemkitError
from memkit.plan.plan import HF_ATTN_IMPLEMENTATION, TrainingPlan
from memkit.spec.resolve import WEIGHT_FILES, ModelSource, resolve_model  # noqa: F401 (the one resolver; main.py uses it)



def load_config(source: ModelSource, *, trust_remote_code: bool = False):
    """The transformers config, read from the local file (no hub access). trust_remote_code
    (--trust-remote-code) and a config whose auto_map names the model's own code: the config that code
    builds (spec/hf_config.py remote_config), from which build_model builds the model's own classes."""
    from memkit.fileio import read_json_object
    from memkit.spec.hf_config import build_hf_config, remote_config

    data = read_json_object(source.config_path, what="config file")
    if trust_remote_code and isinstance(data.get("auto_map"), dict) and "AutoConfig" in data["auto_map"]:
        return remote_config(str(source.folder))
    return build_hf_config(
        data, missing_type=f"{source.config_path} has no 'model_type'; is it a transformers config.json?",
        unbuildable="{where}: transformers cannot build model_type {model_type!r} ({reason})",
        where=str(source.config_path))


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


INITS = ("pretrained", "random")
"""--init: the weights `--model` points at, or fresh seeded weights built from its config."""


def choose_init(source: ModelSource, init: str | None) -> tuple[ModelSource, str, str]:
    """(source, init, note) for `--model` and `--init`, before any rank starts.

    A catalog name or hub id without weights refuses to train unless `--init random` says so (a
    fine-tune of fresh weights is never silent); a catalog name whose hub id is in the local HF
    cache with weights loads those. A local config.json / folder without weights trains fresh
    weights with a note. `note` is one line for the console ('' when there is nothing to say)."""
    from memkit.spec.resolve import with_cached_weights

    if init is not None and init not in INITS:
        raise MemkitError(f"--init {init!r} is not one of {', '.join(INITS)}")
    if init != "random" and not source.has_weights:
        source = with_cached_weights(source)
    if init == "random":
        return source, "random", f"--init random: fresh seeded weights from {source.name}'s config"
    if source.has_weights:
        return source, "pretrained", f"pretrained weights from {source.folder}"
    hub = source.hub_id
    if hub:
        raise MemkitError(
            f"--model {source.name} has no weights here (memkit knows its config, and {hub} is not in the "
            f"local HF cache with weights); pass a folder with weights (--model /path/to/{hub.split('/')[-1]}), "
            f"download it (hf download {hub}), or add --init random for a smoke test on fresh weights")
    if init == "pretrained":
        raise MemkitError(f"--init pretrained: {source.name} holds no weights ({', '.join(WEIGHT_FILES[:2])}, ...); "
                          "pass the folder save_pretrained wrote, or --init random")
    return source, "random", (f"{source.name} holds no weights: training fresh seeded weights from its config "
                              "(--init random says so)")


AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM",
                "seq-cls": "AutoModelForSequenceClassification", "token-cls": "AutoModelForTokenClassification"}
"""The transformers auto class of each data task (transformers models/auto/modeling_auto.py)."""
_MAPPINGS = {"seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"}


def data_task(plan: TrainingPlan, config):
    """The runner's DataTask (memkit/train/task_data.py) for the plan on this model: --task causal-lm on an
    encoder-decoder (config.is_encoder_decoder: BART, T5) is its seq2seq LM; the plan's head otherwise.
    Refuses, in one line, what the runner cannot train."""
    from memkit.train.task_data import DataTask

    model_type = getattr(config, "model_type", "?")
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    task = "seq2seq" if plan.task == "causal-lm" and enc_dec else plan.task
    if plan.target_len and task != "seq2seq":
        raise MemkitError(f"--target-len {plan.target_len}: {model_type} with --task {plan.task} has no decoder "
                          "of its own length; drop --target-len (it is for encoder-decoders such as BART / T5)")
    if task == "causal-lm":
        return DataTask(task=task)
    if plan.is_quantized or plan.pp > 1 or plan.tp > 1 or plan.loss != "standard":
        what = ("QLoRA" if plan.is_quantized else f"--tp {plan.tp} --pp {plan.pp}" if plan.tp * plan.pp > 1
                else f"--loss {plan.loss}")
        raise MemkitError(f"{what} with a {task} model ({model_type}): the runner trains these unsplit, unquantized, "
                          "with the standard loss; plan with --tp 1 --pp 1, LoRA instead of QLoRA, --loss standard")
    import transformers.models.auto.modeling_auto as auto

    if model_type not in getattr(auto, _MAPPINGS[task]):
        raise MemkitError(f"--task {plan.task}: transformers has no {AUTO_CLASSES[task][len('AutoModelFor'):]} "
                          f"model for model_type {model_type!r}; use a model that has one, or another --task")
    return DataTask(task=task, num_labels=plan.num_labels, target_len=plan.target_len,
                    decoder_start_token_id=getattr(config, "decoder_start_token_id", None),
                    decoder_pad_token_id=getattr(config, "pad_token_id", None))


def build_model(source: ModelSource, config, *, attention: str, seed: int, pretrained: bool = True,
                task: str = "causal-lm", num_labels: int = 2, pad_token_id: int | None = None):
    """The task's model (AUTO_CLASSES) in fp32: the folder's weights when `pretrained` and it has
    them, else fresh seeded weights; a classification head is fresh either way, of `num_labels`
    outputs. pad_token_id: the tokenizer's, which a decoder's sequence classifier reads to find
    each row's last token (transformers ...ForSequenceClassification.forward) when the config has none.

    Under ZeRO-3 (zero3_init_flag) transformers builds it inside deepspeed.zero.Init, so each
    rank only ever holds its partition (transformers: integrations/deepspeed.py).
    """
    import torch
    # accelerate's set_seed, not transformers': the same seeding (random, numpy, torch and every
    # device's manual_seed_all; accelerate/utils/random.py and transformers/trainer_utils.py,
    # set_seed), but importing transformers.trainer_utils imports peft, which imports bitsandbytes,
    # which torch.compile-registers its ops and so imports torch._inductor: ~2.8 CPU s per rank
    # for plans that use none of them (measured, the tiny Llama of tests/e2e/runner_util.py).
    from accelerate.utils import set_seed
    import transformers

    from memkit.spec.hf_config import remote_kwargs

    auto_class = getattr(transformers, AUTO_CLASSES[task])
    remote = remote_kwargs(config)  # the model's own classes (load_config under --trust-remote-code)
    if remote and AUTO_CLASSES[task] not in (getattr(config, "auto_map", None) or {}):
        raise MemkitError(f"--model {source.name}: its auto_map names no {AUTO_CLASSES[task]} class "
                          f"({', '.join(getattr(config, 'auto_map', None) or {}) or 'none'}); the runner trains "
                          "the model class its own code declares for the task")
    if task == "causal-lm" and not remote and not any(arch.endswith("ForCausalLM")
                                                      for arch in (config.architectures or ["?ForCausalLM"])):
        raise MemkitError(f"--model {source.name} is a {config.architectures[0]}; the runner trains causal "
                          "language models (…ForCausalLM), encoder-decoders (…ForConditionalGeneration) and, "
                          "with --task seq-cls / token-cls, classifiers")
    if task in ("seq-cls", "token-cls"):
        config.num_labels = num_labels  # a fresh head of num_labels outputs (PretrainedConfig.num_labels)
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = pad_token_id
    set_seed(seed)
    kwargs = {"attn_implementation": HF_ATTN_IMPLEMENTATION[attention], "dtype": torch.float32, **remote}
    try:
        if pretrained and source.has_weights:
            model = auto_class.from_pretrained(str(source.folder), config=config, **kwargs)
        else:
            model = auto_class.from_config(config, **kwargs)
    except ImportError as exc:  # e.g. flash_attention_2 without the flash-attn package
        raise MemkitError(f"attention {attention!r}: {exc}") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # no KV cache while training
    return model


def build_quantized(source: ModelSource, config, plan: TrainingPlan, *, seed: int, device, pretrained: bool = True):
    """build_model's model with its linears in 4 bits on `device`, prepared for k-bit training
    (memkit/train/quantize.py): the folder's checkpoint, or the fresh seeded weights through a
    temporary save."""
    from memkit.train.quantize import load_quantized, quantize_fresh

    if source.has_weights and pretrained:
        return load_quantized(source.folder, plan, device=str(device), config=config)
    return quantize_fresh(build_model(source, config, attention=plan.attention, seed=seed, pretrained=False),
                          plan, device=str(device))


def task_loss_sum(model, batch: dict, task: str):
    """Sum of the losses of a task micro-batch (task_data.py's rows), in fp32: token cross-entropy of
    a seq2seq decoder (labels not shifted: the decoder inputs are, data.PackedData.decoder_input_ids)
    or a token classifier, or one cross-entropy per row of a sequence classifier; IGNORE_INDEX
    skipped (transformers loss/loss_utils.py ForTokenClassification / the seq-cls single_label path)."""
    import torch

    from memkit.train.task_data import IGNORE_INDEX

    logits = task_logits(model, batch)
    labels = batch["labels"].to(logits.device)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def task_logits(model, batch: dict):
    """The model's logits on a task batch: the encoder's ids and mask, and a seq2seq decoder's inputs."""
    keys = ("input_ids", "attention_mask", "decoder_input_ids")
    return model(**{k: batch[k] for k in keys if batch.get(k) is not None}).logits


def apply_plan(model, plan: TrainingPlan, task: str = "causal-lm"):
    """Activation checkpointing (all or the first K blocks), the loss head and LoRA as the plan
    says (memkit/train/techniques.py); returns the (maybe wrapped) model."""
    from memkit.train.techniques import apply_checkpointing, apply_loss

    apply_checkpointing(model, plan.checkpointing)
    apply_loss(model, plan)
    if plan.is_lora:
        from peft import LoraConfig, get_peft_model

        available = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in plan.lora_targets if t not in available]
        if missing:
            linears = sorted(n for n in available if n.endswith("proj") or n in ("c_attn", "c_proj", "fc1", "fc2"))
            raise MemkitError(f"LoRA targets {missing} are not modules of this model; try some of {linears}")
        from memkit.emit.trainer import lora_config

        # the fields the bundle's adapter_config.json holds, the task type of the model the runner built
        config = LoraConfig(**lora_config(plan, model_class=AUTO_CLASSES[task]))
        model = get_peft_model(model, config)
    return model


def count_params(model) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned parameters report ds_numel."""
    total = trainable = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", None) or param.numel()
        if type(param).__name__ == "Params4bit" and param.quant_state is not None:  # two elements per byte
            numel = param.quant_state.shape.numel()
        total += numel
        if param.requires_grad:
            trainable += numel
    return total, trainable


def has_batchnorm(model) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())
