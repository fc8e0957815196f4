"""How many of `suggest`'s no-fit hints ("a GPU with >= X GiB", ">= X GiB host RAM") actually fit when
the missed plan is re-estimated at that size. Prints one line; asserts nothing.

    python benchmarks/no_fit_hints.py
"""
import re
from dataclasses import replace
from memkit.planner import NoPlanFits, Request, search
from memkit.estimate.memory import estimate_memory
from memkit.spec.hardware import Hardware, find_gpu, custom_gpu
from memkit.spec.hf import load_model_spec
from memkit.units import GIB
total = bad = htotal = hbad = 0
for model in ["llama-2-7b", "llama-2-13b", "llama-2-70b", "mistral-7b", "qwen3-0.6b"]:
    spec = load_model_spec(model)
    for gpu in ["t4", "rtx-4090", "a100-40gb", "v100-16gb"]:
        for ng in (1, 2, 8):
            for host in (16, 64, 256):
                for head in (0.05, 0.1, 0.3):
                    hw = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=ng, num_nodes=1, host_ram_bytes_per_node=host * GIB)
                    req = Request(model=spec, hardware=hw, global_batch_size=16, seq_len=2048, headroom=head)
                    try:
                        search(req); continue
                    except NoPlanFits as exc:
                        misses = exc.misses
                    for m in misses:
                        for need in m.needs:
                            g = re.search(r"a GPU with >= ([0-9.]+) GiB", need)
                            if g:
                                total += 1
                                size = float(g.group(1))
                                est = estimate_memory(spec, m.plan, replace(hw, gpu=custom_gpu(int(size * GIB), like=hw.gpu)))
                                bad += est.nvidia_smi_peak_bytes > int((1 - head) * size * GIB)
                            h = re.search(r">= ([0-9.]+) GiB host RAM", need)
                            if h:
                                htotal += 1
                                size = float(h.group(1))
                                est = estimate_memory(spec, m.plan, replace(hw, host_ram_bytes_per_node=int(size * GIB)))
                                hbad += est.host_bytes_per_node > size * GIB
print(f"GPU-size hints that do not fit when re-estimated: {bad}/{total}; host-RAM hints: {hbad}/{htotal}")
