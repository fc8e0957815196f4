"""Variable-length steps through the caching allocator (memkit/estimate/varlen.py): batching and
padding exactly, the CUDA allocator's rules on hand-worked traces, a real variable-length CPU run
measured against the replay, and the CLI's one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memkit.errors import MemkitError
from memkit.estimate.allocator import AllocatorConfig, replay
from memkit.estimate.memory import estimate_memory
from memkit.estimate.varlen import (ORDERS, _sample, estimate_varlen, padding_waste, parse_lengths,
                                    step_lengths, step_orders)
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

MIB = 2 ** 20
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2000,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def test_parse_lengths_histogram_and_bare_lengths():
    assert parse_lengths("3:2,5") == [3, 3, 5]
    for bad in ("12:x", "0:3", "", "4:0"):
        with pytest.raises(MemkitError):
            parse_lengths(bad)


def test_step_lengths_per_padding():
    lengths = [10, 300, 40, 70, 600]  # batches of 2 in order: (10, 300), (40, 70), (600,)
    kw = dict(micro_batch=2, seq_len=512, shuffle=False)
    assert step_lengths(lengths, padding="longest", **kw) == [300, 70, 512]  # 600 truncated to seq_len
    assert step_lengths(lengths, padding="multiple", multiple=64, **kw) == [320, 128, 512]
    assert step_lengths(lengths, padding="seq-len", **kw) == [512, 512, 512]
    # packed: 10+300+40+70+512 = 932 tokens fill ceil(932 / (2 x 512)) = 1 step
    assert step_lengths(lengths, padding="packed", **kw) == [512]
    steps = step_lengths(lengths, padding="longest", **kw)
    # computed tokens 2 x (300 + 70 + 512) = 1764, real 932
    assert padding_waste(lengths, steps, micro_batch=2, seq_len=512) == pytest.approx(1 - 932 / 1764)
    shuffled = step_lengths(lengths, padding="longest", micro_batch=2, seq_len=512, seed=3)
    assert len(shuffled) == 3 and max(shuffled) == 512 and set(shuffled) <= {10, 300, 40, 70, 512}
    assert shuffled == step_lengths(lengths, padding="longest", micro_batch=2, seq_len=512, seed=3)  # seeded
    with pytest.raises(MemkitError):
        step_lengths(lengths, micro_batch=2, seq_len=512, padding="bucket")


def test_sampled_steps_keep_the_longest_step_at_its_own_place():
    """Each step is a new record only if it is longer than every step before it; where the longest
    step sits decides how many records come before it (hand-worked below)."""
    steps = [0, 1, 2, 3, 100, 5, 6, 7, 8, 9]
    # stride 10/3: indices 0, 3, 6; the longest (index 4) replaces the nearest pick (index 3)
    assert _sample(steps, 3) == [0, 100, 6]
    assert _sample(steps, 20) == steps  # short epochs are replayed whole, in order

    def one_tensor_per_step(sizes_mib):
        events = []
        for i, size in enumerate(sizes_mib):
            events += [(i, size * MIB), (i, None)]
        return replay(events).reserved_peak_bytes // MIB

    # 40: new segment; 100: new (40 stays cached); 60 and 80: best fit is the 100 MiB block, split
    # (remainder > 1 MiB, should_split): 40 + 100 reserved
    assert one_tensor_per_step([40, 100, 60, 80]) == 140
    # the same steps with the longest moved last: every step a record, every one a new segment
    assert one_tensor_per_step([40, 60, 80, 100]) == 40 + 60 + 80 + 100


def test_cuda_rules_on_a_hand_worked_trace():
    """30 MiB allocated and freed, then 40 MiB. Default segments: the 30 MiB segment
    (get_allocation_size: >= 10 MiB rounds to 2 MiB) is too small for 40 and stays cached, so
    40 MiB more is cudaMalloc'd: 70 MiB reserved. expandable_segments: one segment that maps
    20 MiB pages, 40 MiB for the first request, which then holds the second: 40 MiB."""
    events = [("a", 30 * MIB, 0), ("a", None), ("b", 40 * MIB, 0)]
    assert replay(events, AllocatorConfig()).reserved_peak_bytes == 70 * MIB
    assert replay(events, AllocatorConfig(expandable_segments=True)).reserved_peak_bytes == 40 * MIB
    # shorter after longer: the cached 30 MiB block is split for 25 MiB (remainder > 1 MiB): no new segment
    shorter = [("a", 30 * MIB, 0), ("a", None), ("b", 25 * MIB, 0)]
    assert replay(shorter, AllocatorConfig()).reserved_peak_bytes == 30 * MIB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return load_model_spec(str(folder))


def test_one_length_replays_as_the_fixed_shape_estimate(tiny):
    plan = TrainingPlan(precision="bf16", micro_batch_size=2, seq_len=256, lora_rank=8)
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    for alloc_conf in ("default", "expandable"):  # each replay prices the allocator it names
        fixed = estimate_memory(tiny, plan.with_(alloc_conf=alloc_conf), hw)
        v = estimate_varlen(tiny, plan, hw, [256, 256, 256], expandable_segments=alloc_conf == "expandable")
        assert v.allocated_peak_bytes == fixed.allocated_peak_bytes
        assert v.single_shape_reserved_bytes == fixed.reserved_peak_bytes
        assert v.lengths == (256,)


def test_growing_lengths_cost_reserved_memory_that_expandable_segments_avoid():
    """Llama-3.2-1B LoRA, steps of 256 -> 1024 tokens: each longer step's activations need segments
    the shorter steps' cached ones cannot hold (default segments), while one expandable segment
    grows in place."""
    model = load_model_spec("llama-3.2-1b")
    plan = TrainingPlan(precision="bf16", micro_batch_size=4, seq_len=1024, lora_rank=16)
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    steps = [256, 512, 768, 1024]
    default = estimate_varlen(model, plan, hw, steps, expandable_segments=False)
    expandable = estimate_varlen(model, plan, hw, steps, expandable_segments=True)
    single = estimate_memory(model, plan.with_(alloc_conf="default"), hw)
    assert default.allocated_peak_bytes >= single.allocated_peak_bytes
    # the same tensors; expandable segments split every block (should_split: >= 512 B left), so no
    # unsplit remainder counts as allocated
    assert default.allocated_peak_bytes >= expandable.allocated_peak_bytes > 0.999 * default.allocated_peak_bytes
    assert default.reserved_peak_bytes > 1.2 * single.reserved_peak_bytes  # the shorter steps' segments stay cached
    assert expandable.reserved_peak_bytes < default.reserved_peak_bytes
    assert default.nvidia_smi_peak_bytes - default.reserved_peak_bytes == \
        single.nvidia_smi_peak_bytes - single.reserved_peak_bytes  # context and what lives outside


@pytest.mark.parametrize("plan", [
    TrainingPlan(precision="fp32", micro_batch_size=2, seq_len=256, lora_rank=8,
                 lora_targets=("q_proj", "v_proj")),
    TrainingPlan(precision="bf16", micro_batch_size=2, seq_len=256),
], ids=["lora-fp32", "full-bf16"])
def test_variable_length_cpu_run_within_5pct_of_the_replay(tiny, plan):
    """A real run of steps at 128, 256, 192 tokens on CPU, peak live-tensor bytes: the CPU allocator
    does not cache (each tensor its own malloc), so the replay's peak is the peak of its longest
    step, and so is the run's."""
    from memkit.calibrate.cpu_step import measure_training

    steps = [128, 256, 192]
    measured = measure_training(LLAMA, plan, seq_lens=steps)["peak_bytes"]
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    v = estimate_varlen(tiny, plan, hw, steps, expandable_segments=False, device="cpu")
    assert v.reserved_peak_bytes == v.allocated_peak_bytes
    assert abs(v.allocated_peak_bytes / measured - 1) <= 0.05


def test_cli_bad_lengths_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memkit.cli.main", "estimate", "--model", "llama-3.2-1b",
                           "--gpu", "a100-80gb", "--lengths", "12:x"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--lengths" in proc.stderr


@pytest.mark.parametrize("fmt", ["prompt_completion", "alpaca", "text", "chat"])
def test_data_histogram_equals_the_runners_tokenisation(tmp_path, fmt):
    """estimate --data's lengths are the tokens per example the runner trains on: prepare_data with
    --packing off puts each example in its own row, attention_mask 1 on its tokens."""
    import copy

    from memkit.train.data import example_lengths, prepare_data
    from memkit.train.tokenizer import byte_tokenizer

    texts = ["a", "a much longer example, with a few more words in it", "mid-sized one"]
    records = {"prompt_completion": [{"prompt": t, "completion": " ok"} for t in texts],
               "alpaca": [{"instruction": t, "input": "", "output": "fine"} for t in texts],
               "text": [{"text": t} for t in texts],
               "chat": [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "yes"}]}
                        for t in texts]}[fmt]
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = copy.deepcopy(byte_tokenizer())
    lengths = example_lengths(str(path), tok)
    data = prepare_data(str(path), copy.deepcopy(byte_tokenizer()), seq_len=1024, max_positions=None,
                        vocab_size=320, packing=False)
    assert lengths == data.attention_mask.sum(dim=1).tolist()
    assert len(set(lengths)) == 3


def test_cli_data_prints_both_segment_settings(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n, "completion": " y"}) + "\n" for n in (10, 200, 90, 40)))
    proc = subprocess.run([sys.executable, "-m", "memkit.cli.main", "estimate", "--model", "llama-3.2-1b",
                           "--gpu", "a100-80gb", "--micro-batch-size", "2", "--seq-len", "256", "--data", str(path),
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    v = json.loads(proc.stdout)["variable_length"]
    # byte tokenizer: prompt + " y" + EOS = n + 3 tokens
    assert v["samples"] == 4 and v["longest_sample"] == 203 and v["steps"] == 2
    assert v["expandable_segments"]["reserved_peak_bytes"] <= v["default_segments"]["reserved_peak_bytes"]


@pytest.mark.parametrize("task", ["seq-cls", "token-cls"])
def test_one_length_replays_the_plans_task_head(task):
    """The replay prices the plan's --task head (a classifier's labels per sequence / per token, not
    the masked-LM head), as the fixed-shape estimate does (spec/generic.py task_spec)."""
    from memkit.spec.hf import spec_from_config

    bert = spec_from_config({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 5000,
                             "max_position_embeddings": 256}, name="bert")
    plan = TrainingPlan(micro_batch_size=2, seq_len=128, task=task, num_labels=3)
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    fixed = estimate_memory(bert, plan, hw)
    v = estimate_varlen(bert, plan, hw, [128, 128], expandable_segments=False)
    assert v.allocated_peak_bytes == fixed.allocated_peak_bytes
    assert fixed.allocated_peak_bytes < estimate_memory(bert, TrainingPlan(micro_batch_size=2, seq_len=128),
                                                        hw).allocated_peak_bytes  # no b x s x 5000 logits


def test_step_orders_are_seeded_shuffles_of_one_epoch():
    lengths = [10, 300, 40, 70, 600, 90, 20]
    kw = dict(micro_batch=1, seq_len=512)
    orders = step_orders(lengths, **kw)
    assert len(orders) == ORDERS
    assert orders == [step_lengths(lengths, seed=s, **kw) for s in range(ORDERS)]
    assert all(sorted(o) == sorted(min(n, 512) for n in lengths) for o in orders)  # batch 1: the same steps
    assert len({tuple(o) for o in orders}) > 1
    # one shape per step: the order cannot matter, one order is replayed
    assert step_orders(lengths, padding="seq-len", **kw) == [[512] * 7]
    assert len(step_orders(lengths, padding="packed", **kw)) == 1


def test_several_orders_report_the_median_order():
    """A step longer than all before it leaves the shorter steps' segments cached, so an order that
    climbs to its longest step reserves more than one that starts there; of three orders the figure
    is the middle one's, and each order's reserved peak is reported."""
    model = load_model_spec("llama-3.2-1b")
    plan = TrainingPlan(precision="bf16", micro_batch_size=2, seq_len=1024, lora_rank=8)
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    climbing, falling, mixed = [256, 512, 768, 1024], [1024, 768, 512, 256], [512, 256, 1024, 768]
    alone = [estimate_varlen(model, plan, hw, o, expandable_segments=False).reserved_peak_bytes
             for o in (climbing, falling, mixed)]
    assert alone[0] > alone[2] > alone[1]
    v = estimate_varlen(model, plan, hw, climbing, orders=(falling, mixed), expandable_segments=False)
    assert v.reserved_by_order == tuple(alone)
    assert v.reserved_peak_bytes == alone[2] and v.num_steps == 4
    single = estimate_varlen(model, plan, hw, [1024], expandable_segments=False)
    assert v.single_shape_reserved_bytes == single.single_shape_reserved_bytes
