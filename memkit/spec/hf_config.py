"""The one builder of a transformers config object from a config.json dict, and the questions
asked of it before any model is built (which LM auto class, which module lists are the blocks).

Every caller -- the traced estimate (estimate/traced.py), the generic spec (generic.py), the runner
(train/model.py) and the CPU measurement (calibrate/cpu_step.py) -- builds through
`build_hf_config`; each keeps its own one-line error (what it was given and the fix), passed in.
torch and transformers are imported lazily: config-only commands stay instant.
"""
from __future__ import annotations

from memkit.errors import MemkitError

# Auto classes memkit trains, in the order a model type is looked up.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM")


def build_hf_config(config: dict, *, missing_type: str | None = None, unbuildable: str | None = None,
                    drop_private: bool = False, where: str = ""):
    """`transformers.AutoConfig.for_model(config['model_type'], **the other keys)`.

    missing_type: the error when the dict has no 'model_type' (None: a KeyError, for callers that
    checked it already). unbuildable: the error when transformers refuses the keys, a format string
    with {model_type}, {exc} (its text), {reason} (the same on one line) and {where} (`where`, e.g.
    the file's path); None: transformers' exception propagates. drop_private: leave out keys starting with '_' (`_name_or_path`, ...)."""
    from transformers import AutoConfig

    data = {k: v for k, v in config.items() if not (drop_private and k.startswith("_"))}
    if REMOTE_CODE_KEY in data:
        return remote_config(data[REMOTE_CODE_KEY])
    if "model_type" not in data and missing_type is not None:
        raise MemkitError(missing_type)
    model_type = data.pop("model_type")
    if unbuildable is None:
        return AutoConfig.for_model(model_type, **data)
    from transformers import CONFIG_MAPPING, __version__

    if model_type not in CONFIG_MAPPING:  # transformers' own message lists every type it knows: hundreds
        reason = f"transformers {__version__} has no model type {model_type!r}"
        if isinstance(data.get("auto_map"), dict):  # the checkpoint ships its own code (remote_config)
            reason += (f"; the config's auto_map names the model's own code ({', '.join(data['auto_map'])}): "
                       "pass --trust-remote-code to run it")
        raise MemkitError(unbuildable.format(model_type=model_type, exc=reason, where=where, reason=reason))
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 config validators
    except ImportError:  # older huggingface_hub
        StrictDataclassError = ValueError
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, StrictDataclassError) as exc:
        raise MemkitError(unbuildable.format(model_type=model_type, exc=exc, where=where,
                                             reason=" ".join(str(exc).split()))) from None


REMOTE_CODE_KEY = "memkit_remote_code_folder"
"""Set in a config dict (spec/hf.py spec_from_config, under --trust-remote-code) to the model folder whose
own configuration/modeling code builds it: transformers' AutoConfig.from_pretrained(folder,
trust_remote_code=True) runs that code (transformers/dynamic_module_utils.py get_class_from_dynamic_module)."""


def remote_config(folder: str):
    """The config the model folder's own code builds (--trust-remote-code), marked so that every
    from_config of it passes trust_remote_code too (remote_kwargs)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    except Exception as exc:  # the model's own code, run as the user asked: any failure is its
        raise MemkitError(f"--trust-remote-code: the config code in {folder} failed ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]}); check the folder holds the model's "
                          "configuration_*.py and modeling_*.py named by auto_map") from None
    hf_config.memkit_remote_code = True
    return hf_config


def remote_kwargs(hf_config) -> dict:
    """from_config's trust_remote_code for a config the model's own code built (remote_config)."""
    return {"trust_remote_code": True} if getattr(hf_config, "memkit_remote_code", False) else {}


def build_config(config: dict):
    """The transformers config object of a config.json dict (registered model types included), as
    the traced estimate and the generic spec build it."""
    return build_hf_config(config, drop_private=True, unbuildable=(
        "transformers cannot build model_type {model_type!r} ({exc}); "
        "upgrade transformers or pass a config of a model type it knows"))


def auto_class_for(hf_config) -> str:
    """The LM class memkit trains for this config: an encoder-decoder (`is_encoder_decoder`: BART, T5)
    its seq2seq LM; an encoder (a masked-LM class and not `is_decoder`: ELECTRA, BERT, DistilBERT) its
    masked LM -- e.g. ElectraForCausalLM is the encoder misused as a decoder (transformers warns
    "add `is_decoder=True`", electra/modeling_electra.py ElectraForCausalLM.__init__), and
    BartForCausalLM is BART's decoder alone without the encoder (bart/modeling_bart.py); else the
    first of AUTO_CLASSES whose mapping builds this config class."""
    import transformers

    order = list(AUTO_CLASSES)
    if remote_kwargs(hf_config):  # the model's own classes, as its auto_map names them
        auto_map = getattr(hf_config, "auto_map", None) or {}
        for name in order:
            if name in auto_map:
                return name
        raise MemkitError(f"--trust-remote-code: the auto_map of model_type {hf_config.model_type!r} names no "
                          f"{', '.join(AUTO_CLASSES)} class ({', '.join(auto_map) or 'empty'}); memkit estimates "
                          "language-model training")
    if getattr(hf_config, "is_encoder_decoder", False):
        order.remove("AutoModelForSeq2SeqLM")
        order.insert(0, "AutoModelForSeq2SeqLM")
    elif not getattr(hf_config, "is_decoder", False) \
            and type(hf_config) in transformers.AutoModelForMaskedLM._model_mapping:
        order.remove("AutoModelForMaskedLM")
        order.insert(0, "AutoModelForMaskedLM")
    for name in order:
        if type(hf_config) in getattr(transformers, name)._model_mapping:
            return name
    raise MemkitError(f"model_type {hf_config.model_type!r} has no causal-LM, seq2seq-LM or masked-LM "
                      "class in transformers; memkit estimates language-model training")


def block_lists(model) -> list[tuple[str, object]]:
    """The outermost ModuleLists of repeated blocks: those as long as a layer count of the config (the
    decoder's `layers`/`h`, T5's encoder and decoder `block`), else those holding most parameters."""
    import torch

    counts = {getattr(model.config, k, None) for k in layer_count_keys(model.config) + ["num_layers"]}
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    outer = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists)]
    found = [(n, m) for n, m in outer if len(m) in counts]
    if not found:
        total = sum(p.numel() for p in model.parameters()) or 1
        found = [(n, m) for n, m in outer if sum(p.numel() for p in m.parameters()) >= 0.1 * total]
    return found


def layer_count_keys(hf_config) -> list[str]:
    """Config attributes that set a number of blocks (num_hidden_layers and T5's decoder count)."""
    return [k for k in ("num_hidden_layers", "num_decoder_layers") if isinstance(getattr(hf_config, k, None), int)]


TASK_CLASSES = {"seq-cls": "AutoModelForSequenceClassification", "token-cls": "AutoModelForTokenClassification"}
"""The Auto class of each classification task (TrainingPlan.task); 'causal-lm' is auto_class_for's LM."""

PEFT_TASK_TYPES = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
                   "AutoModelForSequenceClassification": "SEQ_CLS", "AutoModelForTokenClassification": "TOKEN_CLS"}
"""peft TaskType of the model each Auto class builds (peft/utils/peft_types.py TaskType; peft/mapping.py
MODEL_TYPE_TO_PEFT_MODEL_MAPPING picks the PeftModel class from it). A masked LM (ELECTRA, DistilBERT
as LMs) has none: it gets the plain PeftModel, since PeftModelForCausalLM needs the model's
prepare_inputs_for_generation, which those classes lack (peft/peft_model.py)."""
PEFT_SAVED_HEADS = ("classifier", "score")
"""Under SEQ_CLS / TOKEN_CLS peft trains, beside the adapters, every module whose qualified name ends
in one of these (peft 0.21 peft_model.py PeftModelForSequenceClassification.__init__ /
PeftModelForTokenClassification.__init__: classifier_module_names, appended to modules_to_save;
utils/other.py _set_trainable: `key.endswith(target_key)`, so DistilBERT's pre_classifier too)."""


def task_class(task: str, lm_class: str) -> str:
    """The Auto class a plan's --task trains: its classifier (TASK_CLASSES), else the model's LM class
    (ModelSpec.auto_class, auto_class_for)."""
    return TASK_CLASSES.get(task, lm_class)


def peft_task_type(auto_class: str) -> str | None:
    """The peft task_type a LoraConfig for a model of `auto_class` carries (PEFT_TASK_TYPES)."""
    return PEFT_TASK_TYPES.get(auto_class)


def peft_saved_params(model, auto_class: str) -> int:
    """Parameters of the modules peft wraps in ModulesToSaveWrapper for a model of `auto_class`
    under LoRA (PEFT_SAVED_HEADS; 0 for the LMs). ModulesToSaveWrapper.update deep-copies each
    (peft/utils/other.py: `self.modules_to_save[adapter_name] = copy.deepcopy(self.original_module)`),
    freezes the original and trains the copy: the run holds these parameters twice, and the copy's
    gradients and optimizer states. A match nested in an earlier match is inside its copy already."""
    if peft_task_type(auto_class) not in ("SEQ_CLS", "TOKEN_CLS"):
        return 0
    matched: list[str] = []
    total = 0
    for name, module in model.named_modules():
        if name.endswith(PEFT_SAVED_HEADS) and not any(name.startswith(m + ".") for m in matched):
            matched.append(name)
            total += sum(p.numel() for p in module.parameters())
    return total


def label_shape(auto_class: str, micro_batch_size: int, seq_len: int, target_len: int = 0) -> tuple[int, ...]:
    """The labels of one micro-batch: a class per sequence (ForSequenceClassificationLoss,
    transformers/loss/loss_utils.py), a label per token (ForTokenClassification, and the LMs), or per
    decoder token of a seq2seq LM, whose decoder inputs are the labels shifted right
    (bart/modeling_bart.py shift_tokens_right; t5/modeling_t5.py _shift_right): target_len, else seq_len."""
    if auto_class == TASK_CLASSES["seq-cls"]:
        return (micro_batch_size,)
    if auto_class == "AutoModelForSeq2SeqLM":
        return (micro_batch_size, target_len or seq_len)
    return (micro_batch_size, seq_len)
