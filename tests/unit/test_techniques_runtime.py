"""The chunked loss and partial checkpointing as the runner and the Trainer recipe run them
(memkit/train/chunked_loss.py, memkit/train/techniques.py), against the plain computation.

Tolerance: 1e-6 relative (fp32), loss and every gradient compared as whole tensors
(||a - b|| <= 1e-6 ||b||): the chunked loss sums the same terms in another order, so its
float32 result differs from torch's by rounding only.
"""
from __future__ import annotations

import pytest
import torch

from memkit.errors import MemkitError
from memkit.plan.techniques import loss_chunk_tokens
from memkit.train.chunked_loss import IGNORE_INDEX, ChunkedCrossEntropy, chunked_causal_lm
from memkit.train.techniques import apply_checkpointing, refuse_on_cpu

REL = 1e-6
TINY = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
              "max_position_embeddings": 128, "tie_word_embeddings": False},
    "gpt2-tied": {"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "vocab_size": 300,
                  "n_positions": 128, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "bos_token_id": 0, "eos_token_id": 0},
}


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _model(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    data = dict(TINY[name])
    torch.manual_seed(0)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()


def _batch(vocab: int, *, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 48), generator=g)
    labels = ids.clone()
    labels[0, :10] = IGNORE_INDEX  # a prompt without targets
    return ids, labels


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_cross_entropy_equals_torch(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(96, 32, generator=g, requires_grad=True)
    weight = torch.randn(200, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 200, (96,), generator=g)
    labels[::5] = IGNORE_INDEX
    plain = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, ignore_index=IGNORE_INDEX,
                                              reduction="sum")
    gh, gw = torch.autograd.grad(plain, (hidden, weight))
    ours = ChunkedCrossEntropy.apply(hidden, weight, labels, chunk)
    ch, cw = torch.autograd.grad(ours * 1.0, (hidden, weight))
    assert _close(ours, plain) <= REL
    assert _close(ch, gh) <= REL and _close(cw, gw) <= REL


@pytest.mark.parametrize("name", list(TINY))
def test_chunked_causal_lm_equals_hf_loss_and_gradients(name):
    """The Trainer recipe's wrapper: same .loss and the same gradient for every parameter as
    the model's own ForCausalLMLoss (untied Llama head; GPT-2's head tied to the embedding)."""
    ids, labels = _batch(TINY[name]["vocab_size"])
    plain = _model(name)
    loss = plain(input_ids=ids, labels=labels).loss
    loss.backward()
    wrapped = chunked_causal_lm(_model(name))
    out = wrapped(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    assert _close(out.loss, loss) <= REL
    grads = dict(plain.named_parameters())
    for key, param in wrapped.named_parameters():
        assert _close(param.grad, grads[key].grad) <= REL, key
    # Evaluation and generation still get logits.
    with torch.no_grad():
        assert wrapped(input_ids=ids).logits.shape == (2, 48, TINY[name]["vocab_size"])


def test_chunk_rule_is_liger_kernels():
    # liger: inc_factor = cdiv(V, H); chunk = next_power_of_2(cdiv(BT, inc_factor))
    assert loss_chunk_tokens(4096, 128256, 4096) == 128     # cdiv(4096, 32) = 128
    assert loss_chunk_tokens(512, 2000, 256) == 64           # cdiv(512, 8) = 64
    assert loss_chunk_tokens(100, 300, 64) == 32             # cdiv(100, 5) = 20 -> 32


@pytest.mark.parametrize("name", list(TINY))
def test_partial_checkpointing_first_k_blocks_same_gradients(name):
    """--checkpointing 2 of 3 blocks: blocks 0 and 1 recompute, block 2 does not, and every
    gradient equals the run without checkpointing."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    ids, labels = _batch(TINY[name]["vocab_size"])
    plain = _model(name)
    plain(input_ids=ids, labels=labels).loss.backward()
    model = _model(name)
    assert apply_checkpointing(model, "2") == [0, 1]
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [b.gradient_checkpointing for b in blocks] == [True, True, False]
    forwards = []
    for index, b in enumerate(blocks):  # the MLP runs inside the block's (checkpointed) forward
        def counted(*args, _forward=b.mlp.forward, _index=index, **kwargs):
            forwards.append(_index)
            return _forward(*args, **kwargs)
        b.mlp.forward = counted  # (module hooks do not fire inside a non-reentrant recompute)
    model(input_ids=ids, labels=labels).loss.backward()
    # Forward runs blocks 0, 1, 2; backward recomputes blocks 1 and 0.
    assert forwards == [0, 1, 2, 1, 0]
    grads = dict(plain.named_parameters())
    for key, param in model.named_parameters():
        assert _close(param.grad, grads[key].grad) <= REL, key


def test_partial_checkpointing_needs_fewer_blocks_than_the_model():
    with pytest.raises(MemkitError, match="has 3 blocks"):
        apply_checkpointing(_model("llama"), "3")


def test_fused_loss_refused_on_cpu():
    from memkit.plan.plan import TrainingPlan

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run liger-kernel")
    with pytest.raises(MemkitError, match="needs a CUDA GPU"):
        refuse_on_cpu(TrainingPlan(loss="fused"))


def test_paged_adamw_8bit_refused_on_cpu_and_priced_as_8bit_states():
    from memkit.estimate.states import optimizer_state_bytes_per_param
    from memkit.plan.plan import TrainingPlan

    assert optimizer_state_bytes_per_param("paged-adamw-8bit", "bf16") == \
        optimizer_state_bytes_per_param("adamw-8bit", "bf16") == 2 * (1 + 4 / 256)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine pages the states")
    with pytest.raises(MemkitError, match="unified memory"):
        refuse_on_cpu(TrainingPlan(optimizer="paged-adamw-8bit"))


@pytest.mark.parametrize("name", list(TINY))
def test_selective_checkpointing_same_gradients(name):
    """--checkpointing selective: every block checkpointed per op (matmul / attention outputs
    kept, the rest recomputed), gradients equal to the run without checkpointing."""
    ids, labels = _batch(TINY[name]["vocab_size"])
    plain = _model(name)
    plain(input_ids=ids, labels=labels).loss.backward()
    model = _model(name)
    assert apply_checkpointing(model, "selective") == [0, 1, 2]
    model(input_ids=ids, labels=labels).loss.backward()
    grads = dict(plain.named_parameters())
    for key, param in model.named_parameters():
        assert _close(param.grad, grads[key].grad) <= REL, key


@pytest.mark.parametrize("checkpointing", ["2", "selective"])
def test_trainer_recipe_model_code_runs_and_trains_the_plan(checkpointing):
    """The bundle README's lines after from_pretrained, executed as a user would: the model then
    has the plan's checkpointed blocks and the chunked loss, and Trainer's flag stays off (it
    would checkpoint every block)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from memkit.emit.trainer import trainer_recipe
    from memkit.plan.plan import TrainingPlan
    from memkit.train.chunked_loss import ChunkedLossHead

    recipe = trainer_recipe(TrainingPlan(checkpointing=checkpointing, loss="chunked"))
    assert recipe.arguments["gradient_checkpointing"] is False
    scope = {"model": _model("llama")}
    exec("\n".join(recipe.model_code), scope)
    model = scope["model"]
    flags = [b.gradient_checkpointing for b in model.modules() if isinstance(b, GradientCheckpointingLayer)]
    assert flags == ([True, True, False] if checkpointing == "2" else [True, True, True])
    assert isinstance(model.get_output_embeddings(), ChunkedLossHead)
    ids, labels = _batch(TINY["llama"]["vocab_size"])
    reference = _model("llama")(input_ids=ids, labels=labels).loss
    assert _close(model(input_ids=ids, labels=labels).loss, reference) <= REL
