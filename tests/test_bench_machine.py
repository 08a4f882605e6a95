"""The benchmarks' shared helpers: the machine description, common options, JSON output."""
import argparse
import json

import pytest

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


def test_options_keep_each_scripts_own_defaults_and_choices():
    ap = argparse.ArgumentParser()
    machine.add_common_args(ap, threads=None, out="results", out_help="folder for r.json",
                            model="GGUF path only", threads_choices=(1, 2))
    assert ap.parse_args([]).threads is None  # torch's own default
    assert ap.parse_args(["--threads", "2"]).threads == 2
    try:
        ap.parse_args(["--threads", "3"])
        raise AssertionError("--threads 3 accepted outside the choices")
    except SystemExit:
        pass
    help_text = ap.format_help()
    assert "GGUF path only" in help_text and "folder for r.json" in help_text


def test_benchmarks_share_the_helpers_and_leave_sys_path_alone():
    """Every benchmark that times something takes the shared options and records the
    machine; the data makers (make_*.py) take only what applies; none edits sys.path."""
    from pathlib import Path
    scripts = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))
    assert scripts
    for f in scripts:
        text = f.read_text()
        assert "sys.path" not in text, f.name
        if f.name.startswith("make_"):
            continue
        assert "describe(" in text, f"{f.name} does not record the machine"
        # run in vLLM's venv with vLLM's own arguments (a positional HF directory)
        if f.name not in ("vllm_plugin_overhead.py", "vllm_pruning.py"):
            assert "add_common_args(" in text, f"{f.name} has its own --threads/--out"


def test_every_benchmark_engine_decides_on_the_prefix_cache():
    """Each `LLM(...)` a benchmark builds says whether the prefix cache is on: benchmarks
    replay the same prompts, and with the default (on) a repeat would read its prefill from
    the cache instead of computing it (peers.py did, 2026-12-05 to 12-07)."""
    import ast
    from pathlib import Path
    found = 0
    for f in sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py")):
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "LLM"):
                continue
            found += 1
            names = {k.arg for k in node.keywords}
            # a **kwargs dict must name it where it is built (in the same file)
            assert "enable_prefix_caching" in names or (
                None in names and "enable_prefix_caching" in text), f"{f.name}:{node.lineno}"
    assert found >= 15


def test_alternating_children_get_every_option_their_peer_reads(monkeypatch, tmp_path):
    """peers_alternating.py builds each child's options itself: llama.cpp's peer reads
    no_extra_bufts, which the child once lacked (every llama.cpp child died at load)."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import peers
    import peers_alternating

    seen = []

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, a):
            seen.append(a)
            raise Stop

    monkeypatch.setitem(peers.CHILD, "llama.cpp", Recorder)
    for extra, want in (([], False), (["--no-extra-bufts"], True)):
        a = peers_alternating.parse_args(["--child", "llama.cpp", "--work", str(tmp_path / "w"),
                                          "--model", "m.gguf", *extra])
        with pytest.raises(Stop):
            peers_alternating.child(a)
        assert seen[-1].no_extra_bufts is want and seen[-1].model == "m.gguf"
