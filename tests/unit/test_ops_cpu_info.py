"""memkit.train.ops.probe_cpu_once: DeepSpeed's op builders ask py-cpuinfo twice per loaded op
(deepspeed/ops/op_builder/builder.py, OpBuilder.cpu_arch and simd_width, from cxx_args on every
jit_load), and py-cpuinfo answers each call by running its module in a fresh Python process
(cpuinfo/cpuinfo.py, get_cpu_info -> get_cpu_info_json). After probe_cpu_once the process asks
once: the real builder's flags come out the same and the second query starts no process."""
from __future__ import annotations

import resource

import pytest

pytestmark = pytest.mark.slow  # one real py-cpuinfo probe (~0.5 CPU s) and DeepSpeed's import


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _unpatched(cpuinfo):
    """py-cpuinfo's own get_cpu_info, whatever this process did before: tests/conftest.py's
    prebuild() (tests/prebuild_ops.py) may already have routed it through probe_cpu_once."""
    return getattr(cpuinfo.get_cpu_info, "__wrapped__", cpuinfo.get_cpu_info)


def test_the_builder_probes_the_cpu_once_per_process():
    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    from memkit.train.ops import OPS, probe_cpu_once

    builder = get_accelerator().create_op_builder(OPS["fused_adam"])
    before_test, unpatched = cpuinfo.get_cpu_info, _unpatched(cpuinfo)
    cpuinfo.get_cpu_info = unpatched
    try:
        probe_cpu_once()
        probe_cpu_once()  # idempotent: one cache, not a cache of a cache
        assert cpuinfo.get_cpu_info.__wrapped__ is unpatched
        before = _children_cpu_s()
        first = (builder.cpu_arch(), builder.simd_width())
        probed = _children_cpu_s()
        assert probed > before  # the one real probe: py-cpuinfo's child process
        second = (builder.cpu_arch(), builder.simd_width())
        assert second == first and _children_cpu_s() == probed  # answered from the cache
        info = cpuinfo.get_cpu_info()
        info["flags"] = "changed"  # DeepSpeed edits the dict it gets (builder.py, cpu_arch on aarch64)
        assert cpuinfo.get_cpu_info()["flags"] != "changed"
        assert first[0] and first[1]
    finally:
        cpuinfo.get_cpu_info = before_test


def test_one_machine_probes_once_across_processes(tmp_path):
    """With the extensions root, the answer is kept in root/CPU_INFO_CACHE under the machine's
    fingerprint: a later process (here: the cache re-made, as a new rank makes it) reads it without a
    probe; a file written for another fingerprint, or damaged, is probed again and rewritten."""
    import json

    import cpuinfo

    from memkit.train import ops

    before_test, unpatched = cpuinfo.get_cpu_info, _unpatched(cpuinfo)
    path = tmp_path / ops.CPU_INFO_CACHE
    key = ops._cpu_fingerprint()
    if key is None:
        pytest.skip("no /proc/cpuinfo here: the answer is cached per process only")

    def fresh_process_asks() -> tuple[dict, float]:
        cpuinfo.get_cpu_info = unpatched
        ops.probe_cpu_once(tmp_path)
        before = _children_cpu_s()
        info = cpuinfo.get_cpu_info()
        return info, _children_cpu_s() - before

    try:
        first, spent = fresh_process_asks()
        assert spent > 0 and first["arch"] and first["flags"]
        assert json.loads(path.read_text()) == {"fingerprint": key, "info": first}
        second, spent = fresh_process_asks()
        assert second == first and spent == 0
        path.write_text(json.dumps({"fingerprint": "another machine", "info": {"arch": "PPC_", "flags": []}}))
        third, spent = fresh_process_asks()
        assert third == first and spent > 0 and json.loads(path.read_text())["fingerprint"] == key
        path.write_text("{not json")
        fourth, spent = fresh_process_asks()
        assert fourth == first and spent > 0
    finally:
        cpuinfo.get_cpu_info = before_test
