"""The benchmarks' shared helpers: the machine description, common options, JSON output."""
import argparse
import json

from entropic.bench import machine


def test_the_machine_is_described_with_its_cpu_flags_and_load():
    info = machine.describe(threads=1)
    assert info["cpu"] and info["cpus"] >= 1 and info["threads"] == 1
    assert set(info["flags"]) <= set(machine.ISA_FLAGS)
    assert len(info["load_avg"]) == 3
    line = machine.header(info)
    assert info["cpu"] in line and "1 torch thread" in line


def test_common_options_and_json_output(tmp_path):
    ap = argparse.ArgumentParser()
    machine.add_common_args(ap, threads=3, out="x.json")
    a = ap.parse_args([])
    assert (a.threads, a.out, a.model, a.quick) == (3, "x.json", None, False)
    ap = argparse.ArgumentParser()
    machine.add_common_args(ap, out="y.json", model=False, quick=None)
    assert not hasattr(ap.parse_args([]), "model") and not hasattr(ap.parse_args([]), "quick")
    p = machine.write_json(tmp_path / "sub" / "r.json", {"a": 1, "b": [1.5]})
    assert json.loads(p.read_text()) == {"a": 1, "b": [1.5]}
